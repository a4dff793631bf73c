"""The README's "From PyTorch" example runs as written."""

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_readme_from_pytorch_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## From PyTorch\n.*?```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["tokens"].shape[0] == 1 and scope["tokens"].shape[1] > 16  # generate may stop at an EOS
