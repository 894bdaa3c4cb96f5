"""Load a Gated DeltaNet hybrid (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next) with transformers' own code.

Checkpoints go through ``AutoConfig`` / ``AutoModelForCausalLM`` / ``AutoTokenizer`` (never
``trust_remote_code``). A composite ``qwen3_5`` / ``qwen3_5_moe`` checkpoint (text + vision config)
loads as its text-only causal LM (transformers maps it to ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM``; the vision tower is not loaded).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pace_core.accounting import state_bytes
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.model.reference import looks_like_path, portable_reference
from pace_core.shapes import (
    GDN_LAYER_TYPE,
    SUPPORTED_MODEL_TYPES,
    ModelShape,
    check_config_values,
    shape_from_hf_config,
)

if TYPE_CHECKING:  # transformers' model base class: 2 s of imports, which loading a model pays for when it loads one
    from transformers import PreTrainedModel

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class LoadedModel:
    """A loaded hybrid model with its tokenizer and its state geometry.

    ``gdn_layers`` are the decoder-layer indices whose ``layer_types`` entry is ``linear_attention``;
    ``device`` is the device of the input embeddings (the first device under ``device_map``).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    shape: ModelShape
    source: str
    gdn_layers: list[int]
    device: torch.device
    dtype: torch.dtype
    fingerprint: str = ""  # weights_fingerprint(model): which weights, for result caches

    @property
    def output_device(self) -> torch.device:
        """The device of the output embeddings, where a forward's logits appear (the last device under
        ``device_map``; :attr:`device` where they are not placed on one, e.g. offloaded)."""
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return self.device if weight is None or weight.device.type == "meta" else weight.device

    @property
    def reference(self) -> str:
        """The model as a file or command that leaves this machine names it: :func:`portable_reference` of
        :attr:`source` (the embedded model: ``data/models/pace-tiny-qwen35``)."""
        return portable_reference(self.source)

    @property
    def model_type(self) -> str:
        """The ``model_type`` of the loaded (text) config, e.g. ``qwen3_5_text``."""
        return self.model.config.model_type

    def summary(self) -> dict:
        """Architecture summary from the loaded config: layers, GDN layers, heads, head dims, γ,
        the fp32 recurrent-state bytes of one sequence, and the parameter count."""
        s = self.shape
        text = self.model.config.get_text_config(decoder=True)
        return {
            "source": self.source,
            "model_type": self.model_type,
            "layers": s.num_layers,
            "gdn_layers": s.num_gdn_layers,
            "gdn_layer_indices": list(self.gdn_layers),
            "attention_layers": s.num_layers - s.num_gdn_layers,
            "num_k_heads": s.num_k_heads,
            "num_v_heads": s.num_v_heads,
            "d_k": s.d_k,
            "d_v": s.d_v,
            "gamma": s.num_v_heads // s.num_k_heads,
            "hidden_size": text.hidden_size,
            "vocab_size": text.vocab_size,
            "state_bytes_per_sequence_fp32": state_bytes(get_config("fp32"), s, 1),
            "params": sum(p.numel() for p in self.model.parameters()),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }


def gdn_layer_indices(config: PretrainedConfig) -> list[int]:
    """Decoder-layer indices whose ``layer_types`` entry is ``linear_attention`` (text config of a
    composite config)."""
    text = config.get_text_config(decoder=True)
    return [i for i, kind in enumerate(getattr(text, "layer_types", None) or []) if kind == GDN_LAYER_TYPE]


def _not_hybrid(source: str, why: str) -> PaceError:
    return PaceError(
        f"source: {source!r} is not a hybrid Gated DeltaNet model ({why}); "
        f"allowed model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _resolve_source(source: str | os.PathLike | None) -> str:
    if source is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise PaceError(
                f"source: the embedded model directory {str(DEFAULT_MODEL_DIR)!r} does not exist; "
                "allowed: a local checkpoint directory or a hub id (train the embedded model first)"
            )
        return str(DEFAULT_MODEL_DIR)
    source = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(source, str) or not source:
        raise PaceError(f"source: {source!r} not allowed; allowed: a local checkpoint directory or a hub id")
    if looks_like_path(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise PaceError(
                f"source: path {source!r} does not exist; allowed: a local checkpoint directory or a hub id"
            )
        if not path.is_dir():
            raise PaceError(
                f"source: {source!r} is a file; allowed: a checkpoint directory (with config.json) or a hub id"
            )
        return str(path)
    return source


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto":
        return "auto"
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise PaceError(f"dtype: {dtype!r} not allowed; allowed: auto, {', '.join(DTYPES)}")


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise PaceError(f"device: {device!r} not allowed; allowed: cpu, cuda, cuda:<index>, mps") from err


def load_config(source: str | os.PathLike | None = None) -> tuple[str, PretrainedConfig]:
    """Resolve ``source`` and load its config; checks it is a hybrid Gated DeltaNet model.

    Returns ``(resolved source, config)``. Raises PaceError for a missing path, an unreadable
    source or a model without GDN layers.
    """
    resolved = _resolve_source(source)
    try:  # the file's values first: transformers builds lists per layer from them
        values, _ = PretrainedConfig.get_config_dict(resolved)
    except Exception as err:  # OSError (missing, offline), invalid JSON, ...: all the same to the user
        raise PaceError(
            f"source: could not read a transformers config from {resolved!r} ({err}); "
            "allowed: a local checkpoint directory with config.json or a reachable hub id"
        ) from err
    if values.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise _not_hybrid(resolved, f"model type {values.get('model_type')!r}")
    check_config_values(values, f"config.json of {resolved!r}")
    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=False)
    except Exception as err:  # transformers' own validation (ValueError, huggingface_hub's errors)
        raise PaceError(
            f"source: the config.json of {resolved!r} is not valid ({err}); allowed: the checkpoint's original "
            "config.json"
        ) from err
    if not gdn_layer_indices(config):
        raise _not_hybrid(resolved, f"model type {config.model_type!r} but no {GDN_LAYER_TYPE} layers")
    return resolved, config


def _unreadable_weights(folder: str) -> list[str]:
    """``name (why)`` of every safetensors file of a local ``folder`` whose header cannot be read."""
    from safetensors import safe_open

    found = []
    for path in sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []:
        try:
            with safe_open(path, "pt"):
                pass
        except Exception as err:  # safetensors raises its own SafetensorError, or OSError
            found.append(f"{path.name} ({err})")
    return found


def _weights_error(resolved: str, err: Exception) -> PaceError:
    """The PaceError of a failed ``from_pretrained`` of ``resolved``, naming the damaged file when there is one."""
    damaged = _unreadable_weights(resolved)
    if damaged:
        return PaceError(
            f"source: a weights file of {resolved!r} cannot be read, it is damaged or incomplete: "
            f"{'; '.join(damaged)}; allowed: a complete copy of the checkpoint (copy or download it again)"
        )
    if isinstance(err, OSError):  # a hub id offline, a folder without weights
        return PaceError(f"source: could not load the weights from {resolved!r} ({err}); allowed: a local "
                         "checkpoint directory with config.json and its weights, or a reachable hub id")
    return PaceError(f"source: could not load the model from {resolved!r} ({type(err).__name__}: {err}); allowed: "
                     "the config.json and weights of one checkpoint of a supported model")


def _refuse_incomplete(resolved: str, info: dict) -> None:
    """PaceError when a weight of ``resolved`` has another size than its config gives, or one is missing (it
    would be random): ``info`` is ``from_pretrained``'s loading info."""
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        key, stored, expected = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise PaceError(f"source: the weights of {resolved!r} do not fit its config.json: {key} is "
                        f"{list(stored)} in the weights file, {list(expected)} by the config{more}; allowed: the "
                        "config.json and the weights of one checkpoint")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise PaceError(f"source: {resolved!r} lacks weights its config.json needs ({', '.join(missing[:3])}{more}); "
                        "they would be random; allowed: a complete checkpoint (copy or download it again)")


TOKENIZER_PROBE = "The state"
"""A text every tokenizer of a language model turns into tokens (a checkpoint without tokenizer files gives none)."""


def _load_tokenizer(resolved: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``resolved``; PaceError when it cannot be read or turns text into no tokens."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=False)
    except Exception as err:
        raise PaceError(f"source: the tokenizer of {resolved!r} cannot be read ({type(err).__name__}: {err}); "
                        "allowed: a checkpoint with the tokenizer files of its release (e.g. tokenizer.json and "
                        "tokenizer_config.json)") from err
    if not tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]:
        raise PaceError(f"source: {resolved!r} has no tokenizer (it turns text into no tokens: its tokenizer files, "
                        "e.g. tokenizer.json and tokenizer_config.json, are missing); allowed: a checkpoint with the "
                        "tokenizer files of its release (copy them into the folder)")
    return tokenizer


FINGERPRINT_VALUES = 64


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of which weights ``model`` holds: every parameter's name, shape and its first and
    last ``FINGERPRINT_VALUES`` values (as fp32, so fp32 and bf16 loads of a bf16 checkpoint agree).
    Retraining changes it (every value moves); an edit confined to the middle of tensors would not.
    Parameters offloaded by ``device_map`` (on the ``meta`` device) count by name and shape only.
    Reading it costs a few small copies per parameter, also for a model spread over devices."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)};".encode())
            if p.device.type == "meta":
                continue
            flat = p.detach().reshape(-1)
            ends = torch.cat([flat[:FINGERPRINT_VALUES], flat[-FINGERPRINT_VALUES:]]).float().cpu()
            h.update(ends.numpy().tobytes())
    return h.hexdigest()[:16]


def load_model(
    source: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    device_map: str | dict | None = None,
) -> LoadedModel:
    """Load a hybrid Gated DeltaNet checkpoint (local directory or hub id) and its tokenizer.

    ``source`` None loads the embedded model (:data:`DEFAULT_MODEL_DIR`). ``dtype`` is one of
    ``float32``, ``bfloat16``, ``float16``, ``auto`` (the checkpoint's dtype). ``device_map`` (e.g.
    ``"auto"`` for models larger than one GPU) is passed to ``from_pretrained`` and then ``device``
    is not used. The tokenizer pads on the left (decoder-only batches) and gets the EOS token as its
    pad token when it has none. The model is put in eval mode.
    """
    torch_dtype = _resolve_dtype(dtype)
    target = None if device_map is not None else _resolve_device(device)
    resolved, _ = load_config(source)
    kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": False}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model, info = AutoModelForCausalLM.from_pretrained(resolved, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **kwargs)
    except (torch.OutOfMemoryError, MemoryError):
        raise  # too large for this host or device: not a broken checkpoint
    except Exception as err:
        raise _weights_error(resolved, err) from err
    _refuse_incomplete(resolved, info)
    tokenizer = _load_tokenizer(resolved)
    if target is not None:
        try:
            model = model.to(target)
        except torch.OutOfMemoryError:
            raise  # the device is there but too small: not a "device not available"
        except (RuntimeError, AssertionError) as err:
            raise PaceError(
                f"device: {str(target)!r} is not available here ({err}); allowed: cpu or an available device"
            ) from err
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    text = model.config.get_text_config(decoder=True)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        shape=shape_from_hf_config(text),
        source=str(source) if source is not None else resolved,
        gdn_layers=gdn_layer_indices(model.config),
        device=model.get_input_embeddings().weight.device,
        dtype=next(model.parameters()).dtype,
        fingerprint=weights_fingerprint(model),
    )
