"""``vllm-hybrid fork``: vLLM's own tree with every fix of the overlay in
place, as a git repository and a patch series, generated from this
repository's code and patch registry (nothing of vLLM's is stored here).

The modules, bottom up: :mod:`.source` (text and tree of a module),
:mod:`.plan` (the commits and which modules and entries each holds),
:mod:`.options` (what each option and variable becomes),
:mod:`.modules` and :mod:`.symbols` (where each module and name goes),
:mod:`.code`, :mod:`.placement`, :mod:`.rewrite`, :mod:`.upstream` and
:mod:`.wiring` (writing the code there), :mod:`.text` (words),
:mod:`.build` (the files after each commit), :mod:`.suite` (the tests that
go along), :mod:`.series` (git), :mod:`.checks` (the structure points),
:mod:`.sdist` and :mod:`.wheel` (the archive in, a wheel out) and
:mod:`.cli`.
"""
