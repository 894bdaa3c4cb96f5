"""What the pages take of the library beyond :mod:`pace_core.figures` and :mod:`pace_core.errors`, in one place: the
pages import only app_state, pace_core.figures and pace_core.errors (tests/test_layers.py), and a page that needs
another name of pace_core finds it, or adds it, here."""

from pace_core.accounting import best_in_memory, capacity, resident_bits, state_bytes, state_share
from pace_core.analysis.claims import SPREAD_LEVEL, verdict
from pace_core.analysis.compare import (
    axis_table,
    budget_bits,
    evidence,
    gap,
    recommendation,
    stored_config,
    stored_configs,
)
from pace_core.analysis.generation import generate_side_by_side
from pace_core.analysis.structure import strongest_outlier_head, structure_stats
from pace_core.analysis.task_scores import INSTALL_COMMAND as EVAL_INSTALL
from pace_core.analysis.task_scores import TASK_KIND, harness_installed, setting_label, task_axes, task_table
from pace_core.config import HIGH_SHARE_METHODS, NAMED_CONFIGS, PaceConfig, get_config, tagged
from pace_core.export import admit, export_filename, parse_json
from pace_core.frontier import KL, PERPLEXITY, Axis, Point, best_under
from pace_core.heads import high_heads_for
from pace_core.model.reference import portable_reference
from pace_core.provenance import code_label
from pace_core.quant import QuantSpec, fake_quantize
from pace_core.shapes import BUILTIN_SHAPES
from pace_core.vllm import INSTALL_COMMAND as VLLM_INSTALL
from pace_core.vllm import bench as vllm_bench
from pace_core.vllm import check as vllm_check
from pace_core.vllm.settings import serve_command

__all__ = [
    "BUILTIN_SHAPES", "EVAL_INSTALL", "HIGH_SHARE_METHODS", "KL", "NAMED_CONFIGS", "PERPLEXITY", "SPREAD_LEVEL",
    "TASK_KIND", "VLLM_INSTALL", "Axis", "PaceConfig", "Point", "QuantSpec", "admit", "axis_table", "best_in_memory",
    "best_under", "budget_bits", "capacity", "code_label", "evidence", "export_filename", "fake_quantize", "gap",
    "generate_side_by_side", "get_config", "harness_installed", "high_heads_for", "parse_json", "portable_reference",
    "recommendation", "resident_bits", "serve_command", "setting_label", "state_bytes", "state_share", "stored_config",
    "stored_configs", "strongest_outlier_head", "structure_stats", "tagged", "task_axes", "task_table", "verdict",
    "vllm_bench", "vllm_check",
]
