"""The README's Python example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Python API\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
