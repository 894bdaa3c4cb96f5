"""PACE Studio's library: 4-bit recurrent states for Gated DeltaNet hybrids (PACE and its baselines).

Never imports streamlit; the dashboard (app.py, pages/) only calls into this package.
"""

__version__ = "0.1.0"
