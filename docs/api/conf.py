"""Sphinx configuration of pyro_fa's API reference (``make docs``: HTML into ``build/docs``).

The pages are generated from the docstrings (numpydoc), one page per public package, laid out
after Pyro's reference. The build runs with warnings as errors in CI (``make test``).
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

import pyro_fa  # noqa: E402

project = "pyro_fa"
author = "pyro_fa contributors"
copyright = "pyro_fa contributors"
release = version = pyro_fa.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
]

# What each page documents: the package's ``__all__`` (its public names), in source order.
autodoc_default_options = {
    "members": True,
    "imported-members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "none"  # signatures carry them; numpydoc's Parameters section says what they mean
autodoc_inherit_docstrings = False  # torch's docstrings are not numpydoc: an override without one shows none

# numpydoc: one entry per documented method, no autosummary table of class members (Pyro's layout).
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

default_role = "py:obj"
nitpicky = False  # a name the reference does not document (torch, Pyro) is plain text, not a warning
# `cov_factor` in a docstring names the attribute of whichever class it sits in; Sphinx finds one per class.
suppress_warnings = ["ref.python"]

html_theme = "alabaster"
html_title = f"pyro_fa {release}"
html_static_path = []
exclude_patterns = ["_build"]
root_doc = "index"


def _skip_generated_sklearn_members(app, what, name, obj, skip, options):
    """Skip scikit-learn's generated ``set_*_request`` methods (metadata routing): their docstrings are
    scikit-learn's, written for its own glossary."""
    if name.startswith("set_") and name.endswith("_request"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_generated_sklearn_members)
