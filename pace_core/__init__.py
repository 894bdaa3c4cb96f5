"""PACE Studio's library: 4-bit recurrent states for Gated DeltaNet hybrids (PACE and its baselines).

Never imports streamlit; the dashboard (app.py, pages/) only calls into this package.
"""

from pace_core._version import __version__

__all__ = ["__version__", "apply"]


def __getattr__(name: str):
    """``pace_core.apply`` (:func:`pace_core.model.deploy.apply`), imported on first use: importing the
    package stays free of transformers."""
    if name == "apply":
        from pace_core.model.deploy import apply

        return apply
    raise AttributeError(f"module 'pace_core' has no attribute {name!r}")
