"""Control pages for tests that play the daemon: a page in an area of its own."""

from __future__ import annotations

import os

from peerd.controlpage import ControlPage, page_bytes
from peerd.pagearea import Area


class OwnPage(ControlPage):
    """A formatted page, the only slot of its own area; ``fd`` is the area's (pass it to a rank process),
    ``close()`` unmaps it."""

    def __init__(self, npes: int, instance: int, generation: int = 0):
        self.area = Area.create(page_bytes(npes), slots=1)
        self._twins: list[Area] = []
        super().__init__(self.area.address, self.area.size)
        self.format(npes, instance, generation)

    @property
    def fd(self) -> int:
        return self.area.fd

    def twin(self) -> ControlPage:
        """The same page mapped a second time, as another member maps it (unmapped by ``close``)."""
        self._twins.append(Area.attach(os.dup(self.fd)))
        return self._twins[-1].page(0, self.npes, instance=self.instance)

    def close(self) -> None:
        for area in [*self._twins, self.area]:
            area.close()

    def __enter__(self) -> "OwnPage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
