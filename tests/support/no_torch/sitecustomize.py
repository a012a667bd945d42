"""Put on a test server's PYTHONPATH (`server_utils.run_server`): the server runs as on a
user's machine, where pippin's install brings no torch. The suite installs torch for its
reference checks, and transformers imports it whenever it is installed (1-2 s of every
server start, ~150 starts a run); `None` in `sys.modules` makes `importlib.util.find_spec`
report it absent and `import torch` fail, as without it."""

import sys

sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
