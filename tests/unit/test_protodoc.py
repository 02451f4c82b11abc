"""docs/protocol.md is what the declarations generate: change an op and the page must follow."""

from peerd.protodoc import PAGE, markdown


def test_protocol_page_matches_the_code():
    assert PAGE.read_text() == markdown(), "docs/protocol.md is stale: run python -m peerd.protodoc"
