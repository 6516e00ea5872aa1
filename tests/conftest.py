"""Suite-wide settings.

Mooncake: quiet logs and short transfer timeouts so a frozen peer fails a test in
seconds, not the default 30 s of a spinning core.
Hypothesis: no per-example deadline (a loaded 2-core CI machine is slow, not wrong); under
CI=true examples are derandomized so a landing never depends on luck, while local runs
keep exploring new examples.
"""
import os

from hypothesis import settings

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "3")

settings.register_profile("local", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "local")
