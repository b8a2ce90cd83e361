"""The ground floor every other package stands on: user errors, the values, roles and
target files (``config``), fault-injection points, the exact all-or-nothing multi-file writer
(``edits``), and megatron-core's sources from its PyPI wheel (``megatron_source``).

Imports: nothing of quantpatch but ``quantpatch.__version__`` and the format spec
(``quantpatch.runtime.quantpatch_formats``, standard library only)."""
