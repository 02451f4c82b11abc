"""The process's table of open group links (peerd_client.pagelink), under threads."""

from __future__ import annotations

import sys
import threading

from peerd_client.pagelink import GroupLink, _links, close_link, link_for, open_link


def test_a_link_opened_while_another_thread_closes_the_groups_last_one_is_never_lost():
    """open_link took the group's list, then appended to it; a close_link of the group's last link in
    between dropped that list from the table, and the new link with it: tp_agree then found no link and
    voted through the daemon while its peers voted on the page, and every round timed out."""
    lost, switch = [0, 0], sys.getswitchinterval()

    def churn(i: int) -> None:
        for n in range(60_000):
            link = GroupLink(1, 0, 2, f"thread {i}", 60.0, n)
            open_link("churned", link, [])
            if link not in _links.get("churned", []):
                lost[i] += 1
            close_link("churned", link)

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(switch)
    assert lost == [0, 0] and link_for("churned") is None and "churned" not in _links
