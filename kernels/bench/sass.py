"""Static report of the decode kernels compiled for the H200 (sm_90a) on a machine without a GPU: registers,
stack, shared memory and the SASS instruction mix of each kernel a decode token launches.

Each kernel is compiled from the arguments of its real launch (the launch functions of :mod:`kernels` called on
one layer of a benchmark variant, CPU tensors, the kernel's run replaced by a capture), specialised as Triton
specialises a launch, with the GPU's bfloat16 operands: what is reported is what the H200 would run at those
shapes. Triton's version here may differ from the GPU machine's; the report names it. ``--settings`` compiles the
launches of other launch settings (:class:`kernels.settings.SplitSettings` fields, e.g. ``step_maxnreg=96``); with
``--all-launches`` every launch of a kernel is reported (PACE-4/8's launches per bit width: ``dots``, ``dots#2``),
else its first. Usage::

    python3 kernels/bench/sass.py --variant "PACE-4 dP=8" [--kernel dots] [--settings step_maxnreg=96] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.bench.bench import HV, K, V, _inputs, _layer_state
from kernels.plan import DecodePlan, plan_decode
from kernels.pool_step import slot_strides
from kernels.settings import Launch, SplitSettings
from pace_core.backend import REFERENCE

TARGET = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages", "maxnreg")


def compile_launch(fn, args: tuple, kwargs: dict):
    """The launch ``fn[grid](*args, **kwargs)`` compiled for sm_90a, specialised as Triton specialises it (16-byte
    aligned pointers and multiples of 16 marked divisible, ints equal to 1 made constants, except where the
    kernel says not to)."""
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    constants = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    params = [p for p in fn.params if p.name not in constants]
    for p in params[len(args):]:  # constexprs left at their defaults
        if p.is_constexpr and p.has_default:
            constants[p.name] = p.default
    params = [p for p in params if p.name not in constants]
    if len(params) != len(args):
        raise ValueError(f"{fn.__name__}: {len(args)} run-time arguments for {len(params)} parameters")
    signature, attrs = {}, {}
    for p, a in zip(params, args):
        if p.is_constexpr:
            constants[p.name] = a
            continue
        kind, attr = native_specialize_impl(CUDABackend, a, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        if kind == "constexpr":
            constants[p.name] = attr
            continue
        signature[p.name] = kind
        if attr:
            attrs[(fn.arg_names.index(p.name),)] = CUDABackend.parse_attr(attr)
    signature = {name: signature.get(name, "constexpr") for name in fn.arg_names}
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    return triton.compile(source(fn, signature, constants, attrs), target=TARGET, options=options)


def sass_report(compiled) -> dict:
    """Registers, stack, shared memory and the SASS opcode counts of a compiled kernel, with its SASS."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        cuobjdump = shutil.which("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.check_output([str(cuobjdump), "-sass", f.name], text=True)
        usage = subprocess.check_output([str(cuobjdump), "-res-usage", f.name], text=True)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", line)
        if m:
            ops[m.group(1)] += 1
    return {"name": compiled.metadata.name, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)), "shared_bytes": compiled.metadata.shared,
            "instructions": sum(ops.values()), "ops": dict(ops.most_common()), "sass": sass}


def launches(variant: str, B: int, settings: dict | None = None, every: bool = False) -> dict[str, tuple]:
    """Each decode kernel of ``variant``'s token and flush: name -> (kernel, args, kwargs) of its first launch (with
    ``every``, each launch, the second and later named ``name#2`` ..), one layer at batch ``B`` on CPU tensors (stored
    by the reference), the GPU's bfloat16 operands, the buffer holding half a period of records, the launch
    ``settings`` (:class:`kernels.settings.SplitSettings` fields) over the defaults. ``dots``: the Triton dots kernel;
    ``gluon_dots``: the Gluon one (launched per width); ``step``: the Triton one-kernel step, ``gluon_step``: the Gluon
    one (PACE-4 only, one launch); ``pool_step``, ``pool_gluon_step``, ``pool_flush``, ``pool_gluon_flush``: the same
    over a state pool's slots (:mod:`kernels.pool_step`); ``flush``, ``gluon_flush``: as the dots."""
    from kernels import flush, gluon_dots, gluon_flush, gluon_step, packed_step

    st = _layer_state(variant, torch.randn(B, HV, K, V) * 0.05, REFERENCE)
    q, k, v, g, beta = _inputs(B, torch.device("cpu"))
    for _ in range(st.decode_period // 2):
        st.buffer.append(k, v * 0.1, g)
    o = torch.empty(B, HV, V)

    def plan(**launch) -> DecodePlan:
        return plan_decode(st.checkpoint, st.buffer, st.exact_current,
                           Launch.of(SplitSettings(**{**(settings or {}), **launch})), bf16=True)

    def pool(p: DecodePlan) -> None:  # the batch's rows as a state pool's slots (kernels.pool_step)
        strides = slot_strides(p.split.launches[False][0].ckpt, p.records.args())
        packed_step.launch_packed_step(p, st.buffer, q, k, v, g, beta, o, rows=torch.arange(B), strides=strides)

    def pool_flush(p: DecodePlan) -> None:
        strides = tuple(slot_strides(launch.ckpt, p.records.args()) for launch in p.split.per_width)
        flush.launch_flush(p, st.buffer, full=torch.tensor([B, *range(B)]), strides=strides)  # every slot full

    calls = {
        "dots": (packed_step._ckpt_dots_kernel, lambda: packed_step.launch_dots(plan(gluon_dots=False), q, k)),
        "gluon_dots": (gluon_dots._dots_kernel, lambda: packed_step.launch_dots(plan(dots_per_part=True), q, k)),
        "records": (packed_step._record_step_kernel,
                    lambda: packed_step.launch_records(plan(), st.buffer, q, k, v, g, beta, o)),
        "step": (packed_step._ckpt_step_kernel,
                 lambda: packed_step.launch_packed_step(plan(fused_step=True, gluon_step=False), st.buffer, q, k, v, g,
                                                        beta, o)),
        "gluon_step": (gluon_step._step_kernel,
                       lambda: packed_step.launch_packed_step(plan(fused_step=True), st.buffer, q, k, v, g, beta, o)),
        "pool_step": (packed_step._ckpt_step_kernel, lambda: pool(plan(fused_step=True, gluon_step=False))),
        "pool_gluon_step": (gluon_step._step_kernel, lambda: pool(plan(fused_step=True))),
        "flush": (flush._flush_kernel, lambda: flush.launch_flush(plan(gluon_flush=False), st.buffer)),
        "gluon_flush": (gluon_flush._flush_kernel, lambda: flush.launch_flush(plan(), st.buffer)),
        "pool_flush": (flush._flush_kernel, lambda: pool_flush(plan(gluon_flush=False))),
        "pool_gluon_flush": (gluon_flush._flush_kernel, lambda: pool_flush(plan())),
    }
    kernels = {fn for fn, _ in calls.values()}
    out = {}
    for name, (fn, launch) in calls.items():
        seen = {kernel: [] for kernel in kernels}
        for kernel in kernels:  # every kernel a launch function calls is captured, none runs
            kernel.run = lambda *a, grid, warmup, _seen=seen[kernel], **kw: _seen.append((a, kw))
        try:
            launch()
        finally:
            for kernel in kernels:
                del kernel.run
        for i, call in enumerate(seen[fn][:None if every else 1]):  # a kernel the variant launches
            out[name if i == 0 else f"{name}#{i + 1}"] = (fn, *call)
    return out


def settings_arg(pairs: list[str]) -> dict:
    """``key=value`` pairs as launch settings (ints, True / False / None, else the text)."""
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = {"True": True, "False": False, "None": None}.get(value, int(value) if value.isdigit() else value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="PACE-4 dP=8")
    ap.add_argument("--kernel", nargs="*", help="kernels to report (default: all)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--settings", nargs="*", default=[], help="launch settings over the defaults, key=value")
    ap.add_argument("--all-launches", action="store_true", help="every launch of a kernel, not only its first")
    ap.add_argument("--dump", type=Path, help="write each kernel's SASS and the reports (JSON) into this folder")
    a = ap.parse_args(argv)
    reports = {}
    settings = settings_arg(a.settings)
    for name, (fn, args, kwargs) in launches(a.variant, a.batch, settings, a.all_launches).items():
        if a.kernel and name not in a.kernel:
            continue
        rep = reports[name] = sass_report(compile_launch(fn, args, kwargs))
        if a.dump:
            a.dump.mkdir(parents=True, exist_ok=True)
            (a.dump / f"{name}.sass").write_text(rep.pop("sass"))
        else:
            rep.pop("sass")
        print(f"{name} ({rep['name']}): {rep['registers']} registers, {rep['stack_bytes']} B stack, "
              f"{rep['shared_bytes']} B shared, {rep['instructions']} SASS instructions")
        print("   " + " ".join(f"{op} {n}" for op, n in rep["ops"].items()))
    if a.dump:
        meta = {"variant": a.variant, "batch": a.batch, "triton": triton.__version__, "target": "sm_90a",
                "settings": settings}
        (a.dump / "sass.json").write_text(json.dumps({**meta, "kernels": reports}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
