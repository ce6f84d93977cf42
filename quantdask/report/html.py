"""Notebooks run with parameters, and exported to HTML reports that open with no network.

A notebook marks its parameters cell with the tag ``parameters``; :func:`execute_notebook`
inserts the caller's values after it (as papermill does), runs every cell in a fresh kernel and
fails on the first error. :func:`write_report` runs the report notebook on a run
directory and writes ``report.html`` there, with the charts' JavaScript inlined once.

>>> write_report("runs/demo")  # doctest: +SKIP
PosixPath('runs/demo/report.html')
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from quantdask import resources
from quantdask.errors import QuantdaskError
from quantdask.store.run_store import RunStore
from quantdask.util import atomic_write, cache_root

NOTEBOOKS_DIR = resources.notebooks_dir()
"""The project's notebooks (quickstart, report, scaling, memory, quality): ``notebooks/`` of a
checkout, ``quantdask/notebooks`` of an installed wheel."""

TEMPLATE_DIR = resources.report_template_dir()
CELL_TIMEOUT_S = 900
RENDERER = "quantdask"
BUNDLE_END = "\n// quantdask: the whole bundle\n"
EMBED_OPTIONS = {"renderer": "svg",
                 "actions": {"export": True, "source": False, "compiled": False,
                             "editor": False}}  # the editor is a web site: not offline


class ReportError(QuantdaskError):
    """A notebook failed to run or export."""


def notebook_path(name: str) -> Path:
    """The path of one of the project's notebooks (``"report"`` or ``"report.ipynb"``), or of
    a notebook file given by its path."""
    path = Path(name)
    if path.suffix == ".ipynb" and path.exists():
        return path
    candidate = NOTEBOOKS_DIR / (name if name.endswith(".ipynb") else f"{name}.ipynb")
    if not candidate.exists():
        known = sorted(p.stem for p in NOTEBOOKS_DIR.glob("*.ipynb"))
        raise ReportError(f"no notebook {name!r}: give a .ipynb path or one of {known}")
    return candidate


def _script_json(value: Any) -> str:
    # Data can hold any text (error messages): "</script>" or "<!--" must not end the script.
    return json.dumps(value).replace("</", "<\\/").replace("<!--", "<\\!--")


def _chart_html(spec: dict, **metadata: Any) -> dict[str, str]:
    """A chart as HTML that draws itself with the ``vegaEmbed`` that :func:`inline_charts`
    loaded, and records whether it rendered (``data-state``) for whoever checks the page."""
    element = f"quantdask-chart-{uuid.uuid4().hex[:12]}"
    script = f"""<div class="quantdask-chart" id="{element}" data-state="pending"></div>
<script type="text/javascript">
(function () {{
  var el = document.getElementById("{element}");
  if (typeof window.vegaEmbed !== "function") {{
    el.dataset.state = "failed";
    el.textContent = "chart library not loaded: call quantdask.report.html.inline_charts() first";
    console.error("quantdask: " + el.textContent);
    return;
  }}
  window.vegaEmbed(el, {_script_json(spec)}, {_script_json(EMBED_OPTIONS)})
    .then(function () {{ el.dataset.state = "rendered"; }})
    .catch(function (error) {{
      el.dataset.state = "failed";
      console.error("quantdask chart:", error);
    }});
}})();
</script>"""
    title = spec.get("title")
    plain = f"<quantdask chart{': ' + json.dumps(title) if title else ''}>"
    return {"text/html": script, "text/plain": plain}


def inline_charts() -> None:
    """Draw Altair charts in this notebook with JavaScript that travels inside the notebook:
    its output (and any HTML exported from it) renders them with no network.

    Call it once, in the notebook's first cell; the Vega bundle (about 1 MB) is written once.
    """
    import altair as alt
    from IPython.display import HTML, display

    if RENDERER not in alt.renderers.names():
        alt.renderers.register(RENDERER, _chart_html)
    alt.renderers.enable(RENDERER)
    display(HTML(f'<script type="text/javascript">{vega_bundle()}</script>'))


def vega_bundle() -> str:
    """vl-convert's Vega JavaScript bundle, ready to sit inside a ``<script>``. Bundling takes
    1.4 s of CPU, in every report's kernel; so it is kept in the user's cache folder
    (``$XDG_CACHE_HOME`` or ``~/.cache``, under ``quantdask/``), one file per vl-convert
    version, and read from there afterwards (built as before where that folder is not
    writable)."""
    from importlib.metadata import version

    import vl_convert

    cached: Path | None = None  # no home folder (RuntimeError): nothing kept
    with contextlib.suppress(OSError, RuntimeError, UnicodeDecodeError):
        cached = cache_root() / f"vega-bundle-vl-convert-{version('vl-convert-python')}.js"
        text = cached.read_text(encoding="utf-8")
        if text.endswith(BUNDLE_END):  # a whole file (it is written all or nothing)
            return text[:-len(BUNDLE_END)]
    # Closing tags inside the bundle would end the <script> early. (vl_convert's stub makes
    # the optional `snippet` required: its default assigns vegaEmbed etc. to `window`.)
    bundle = vl_convert.javascript_bundle().replace(  # type: ignore[call-arg]
        "</script", "<\\/script")
    if cached is not None:
        with contextlib.suppress(OSError):
            atomic_write(cached, lambda f: f.write((bundle + BUNDLE_END).encode()),
                         durable=False)
    return bundle


def _inject_parameters(nb, parameters: dict[str, Any]) -> None:
    import nbformat

    # Paths go in as plain strings: the kernel has no ``PosixPath`` name in scope.
    source = "# Parameters given by the caller\n" + "".join(
        f"{name} = {(os.fspath(value) if isinstance(value, os.PathLike) else value)!r}\n"
        for name, value in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    if parameters and not tagged:
        raise ReportError("the notebook has no cell tagged 'parameters' to receive "
                          f"{', '.join(parameters)}")
    nb.cells.insert(tagged[0] + 1 if tagged else 0, cell)


def _report_kernel_manager():
    """jupyter_client's KernelManager, starting :mod:`quantdask.report.kernel` with this
    Python instead of the ``python3`` kernel spec's command."""
    import sys

    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import KernelManager

    class ReportKernelManager(KernelManager):
        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(argv=[sys.executable, "-m", "quantdask.report.kernel", "-f",
                                    "{connection_file}"],
                              display_name="quantdask report", language="python")

    return ReportKernelManager


def execute_notebook(notebook: str | os.PathLike, parameters: dict[str, Any] | None = None,
                     output: str | os.PathLike | None = None, cwd: str | os.PathLike = ".",
                     timeout_s: int = CELL_TIMEOUT_S):
    """Run every cell of ``notebook`` with ``parameters`` in a fresh Python kernel; return the
    executed notebook (also saved to ``output``). Raises :class:`ReportError` naming the cell
    that failed."""
    import nbformat

    # jupyter_client warns about its own clean-up races at shutdown; nothing to act on.
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = notebook_path(str(notebook))
    nb = nbformat.read(path, as_version=4)
    _inject_parameters(nb, parameters or {})
    # IPC transport: the kernel talks over Unix sockets (an absolute, short path: the kernel
    # runs in ``cwd``), so it opens no TCP port at all.
    # The kernel process's own stderr (shutdown notices, or how it died) goes to a file that
    # is shown only when something failed.
    with tempfile.TemporaryDirectory(prefix="quantdask-kernel-") as scratch, \
            open(os.path.join(scratch, "stderr.log"), "w+") as kernel_stderr:
        # Its connection file there too: by default jupyter_client writes it to a temporary
        # file of its own and leaves it behind, one per report.
        kernel = _report_kernel_manager()(kernel_name="python3", transport="ipc",
                                          ip=os.path.join(scratch, "kernel"),
                                          connection_file=os.path.join(scratch, "kernel.json"))
        client = NotebookClient(nb, km=kernel, timeout=timeout_s, kernel_name="python3",
                                resources={"metadata": {"path": str(cwd)}})
        try:
            # cleanup_kc: shut the kernel down at the end. nbclient does so only for a kernel
            # manager it made itself; given ours, it left each report's kernel running (a
            # process of 300-900 MB) until this process exited.
            client.execute(stderr=kernel_stderr, cleanup_kc=True)
        except CellExecutionError as error:
            raise ReportError(f"notebook {path} failed:\n{error}") from None
        except Exception as error:  # the kernel died or timed out
            kernel_stderr.seek(0)
            raise ReportError(f"notebook {path} failed: {error!r}\nkernel stderr:\n"
                              f"{kernel_stderr.read()[-4000:]}") from error
        finally:
            if output is not None:  # the executed notebook, up to a failing cell too
                _save_trusted(nb, Path(output))
    return nb


def _save_trusted(nb, output: Path) -> None:
    """Write the executed notebook and sign it, so JupyterLab runs its charts' scripts (it does
    not run scripts in outputs it did not produce or trust). Signing is best effort."""
    import nbformat
    from nbformat.sign import NotebookNotary

    nbformat.write(nb, output)
    try:
        NotebookNotary().sign(nb)
    except Exception as error:  # noqa: BLE001 - no writable Jupyter data dir: still a notebook
        logging.getLogger("quantdask.html_report").info("did not sign %s: %s", output, error)


def export_html(nb, output: str | os.PathLike, title: str | None = None) -> Path:
    """Write an executed notebook as a self-contained HTML page (outputs only, no code)."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name=str(TEMPLATE_DIR), exclude_input=True,
                            exclude_input_prompt=True, exclude_output_prompt=True)
    if title:
        nb.metadata["title"] = title  # the template escapes it
    body, _ = exporter.from_notebook_node(nb)
    output = Path(output)
    atomic_write(output, lambda f: f.write(body.encode()))  # a reader never sees half a report
    return output


def write_report(run_dir: str | os.PathLike, output: str | os.PathLike | None = None,
                 notebook: str = "report") -> Path:
    """Run the report notebook on ``run_dir`` and export it: ``RUN_DIR/report.html`` by
    default, next to the executed notebook (``report.ipynb``) for JupyterLab."""
    run_dir = Path(run_dir).resolve()
    store = RunStore(run_dir)
    if not store.is_run_dir():
        raise ReportError(f"{run_dir} is not a run directory (it has no results/); "
                          "give the --run-dir of a sweep")
    output = Path(output) if output else store.report_path
    if output.is_dir():
        raise ReportError(f"-o {output} is a directory; give a file name such as "
                          f"{output / 'report.html'}")
    output.parent.mkdir(parents=True, exist_ok=True)  # before the notebook runs, not after
    nb = execute_notebook(notebook, {"run_dir": str(run_dir)},
                          output=output.with_suffix(".ipynb"), cwd=run_dir)
    return export_html(nb, output, title=f"quantdask report: {run_dir.name}")
