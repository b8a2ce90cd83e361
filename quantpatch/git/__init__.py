"""Git state: the checkout (clean-tree checks, locks, records on ``refs/quantpatch``,
``repo``), the record of the active set (``state``), recorded installs that ``--remove``
undoes byte for byte (``installs``), and the scheme branches a worktree or a sweep runs from
(``scheme_branch``).

Imports: ``quantpatch.base``, ``quantpatch.sites``."""
