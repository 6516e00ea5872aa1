"""Suite-wide settings: quiet Mooncake logs and short transfer timeouts so a frozen peer
fails a test in seconds, not the default 30 s of a spinning core."""
import os

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "3")
