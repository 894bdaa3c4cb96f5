"""The package's version (pyproject's), in a module of its own: every layer may name it, and importing it imports
nothing."""

__version__ = "0.1.0"
