

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the repository: tests/<area>/<file> sit two levels down
