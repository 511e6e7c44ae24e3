"""tools/setup.sh: valid bash, and its pip filter drops the noise a fresh install printed
(issue 22: location warnings of index settings, setuptools' editable-install banner)
while passing everything else, errors included, through."""
from __future__ import annotations

import subprocess

from kvstore.testing import REPO_ROOT

SETUP = REPO_ROOT / "tools" / "setup.sh"

# what `pip install -q` printed on a fresh machine (tools/setup.sh before the filter)
NOISE = """\
WARNING: Location 'file:///opt/pypi-more/simple/pip/' is ignored: it is neither a file nor a directory.
WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored: it is neither a file nor a directory.
  /tmp/pip-build-env-5ftztnye/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
"""


def _filter(text: str) -> str:
    script = f'source <(sed -n "/^filter_pip()/,/^}}/p" {SETUP}); filter_pip'
    done = subprocess.run(["bash", "-c", script], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_setup_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SETUP)], capture_output=True, timeout=30).returncode == 0


def test_pip_noise_is_filtered_and_errors_pass_through():
    assert _filter(NOISE) == ""
    real = "ERROR: Could not find a version that satisfies the requirement torch==9.9\n"
    assert _filter(NOISE + real) == real
    assert _filter(real + NOISE + "WARNING: something else\n") == real + "WARNING: something else\n"
