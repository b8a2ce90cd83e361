"""What the checkout commands do to a Megatron checkout: ``check`` / ``set`` / ``restore``
(``switch``; ``set``'s options merged: ``set_options``), ``init`` and its quant ops
(``init``), the tensor saver's install and its callers (``saver``, ``saver_callers``), one
worktree per scheme (``worktrees``) and the embedded demo (``demo``).

Imports: ``quantpatch.base``, ``quantpatch.sites``, ``quantpatch.git``."""
