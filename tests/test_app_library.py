"""What every page pays for before it shows anything: the app's shared modules (app_state.frame, run on every
page, and app_state.library, which every page imports) import no model code. transformers' model classes and the
model loader cost about 2 s of imports (the first page took 4.6 s with them, 2.5 s without, on the 2-core
machine); a page that runs the model imports them when it loads one."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_shared_app_modules_import_no_model_code():
    code = ("import sys, app_state.frame, app_state.library; "
            "print(*(name in sys.modules for name in ('transformers.modeling_utils', 'pace_core.model.loading')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "False"]
