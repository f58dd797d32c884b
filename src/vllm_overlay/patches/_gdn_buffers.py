"""gdn-output-prealloc's part of the report: ``buffers``, one entry per GDN output buffer this
process allocated (its key, engine, rows and where they came from, dtype source, bytes, the layers
sharing it; ``freed`` once its engine's layers are released). The patch keeps each entry it adds and
changes it with ``BUFFERS.note``. A forked child's list starts empty: the patch's own fork handler
lists again, as inherited, the buffers the child's memory holds."""

from __future__ import annotations

from vllm_overlay import report


class Buffers(report.Items):
    pass


BUFFERS = report.section("buffers", Buffers)
