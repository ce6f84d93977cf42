"""The Python kernel quantdask executes its notebooks in: ipykernel, started as
``python -m quantdask.report.kernel -f CONNECTION_FILE``.

It differs from the stock ``python3`` kernel in one way: jsonschema's optional IRI format
checker is left out (``leave_out_iri_checker``). Altair imports jsonschema, and jsonschema's
format module imports ``rfc3987-syntax`` when it is installed (Jupyter's own dependencies
bring it), which builds an Earley parser at import: 1.9 s of CPU in every report (3.7 s on a
slower machine), for a string format no chart uses.
Without it jsonschema treats that format as unchecked, as it does any format it has no checker
for. A notebook a user opens in JupyterLab runs in their own kernel, unchanged.
"""

import sys


def leave_out_iri_checker() -> None:
    """Keep jsonschema (which altair and nbformat import) from importing ``rfc3987-syntax``
    in this process: 1.9-3.7 s of CPU at import, for a format nothing of ours checks. For
    quantdask's own processes only (this kernel, the ``quantdask`` command, the tests): a
    user's process keeps whatever jsonschema finds."""
    # None: `import` raises ImportError (typeshed types sys.modules values as modules only).
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]


if __name__ == "__main__":
    leave_out_iri_checker()
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()
