"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_train_step_example_runs():
    block = re.search(r"## The train step\n\n```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert float(namespace["metrics"].loss) < 1.0 and not bool(namespace["metrics"].skipped)


def test_quickstart_is_two_commands_and_ci_runs_the_second():
    quickstart = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, re.DOTALL)
    assert len(commands) == 2 and commands[0].endswith("leanstep train")
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1].split("&& ", 2)[2] in ci  # the install-and-test part, after the venv step


def test_bring_your_model_examples_run():
    section = README.read_text().split("## Bring your model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:  # one namespace: the later examples reuse the first's imports and batch
        exec(compile(block, "README.md", "exec"), namespace)
        assert not bool(namespace["metrics"].skipped) and float(namespace["metrics"].loss) >= 0
    assert type(namespace["model"]).__name__ == "MLP"
