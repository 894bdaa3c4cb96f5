"""The dashboard's glue between streamlit and pace_core, one module per concern: ``controls`` (the sidebar's
settings and their URL schema), ``session`` (loading the model), ``compute`` (the pages' cached
computations), ``stored`` (stored results and benchmarks) and ``frame`` (the page frame and sidebar).
Library logic lives in pace_core; these modules only call it."""
