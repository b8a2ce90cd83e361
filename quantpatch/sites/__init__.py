"""The site engine: finds every ``custom_quant_type`` site in a checkout and what it governs
(``discovery``, the ``Site`` record in ``model``), caches that by file content (``cache``), and
rewrites sources with libcst (``codemods``: set a value, insert sites, instrument the saver).

Imports: ``quantpatch.base``."""
