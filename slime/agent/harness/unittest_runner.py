"""The test runner of patch scoring, run inside the scoring sandbox as `python3 -I -c <this file> TEST_ID...`.

It is slime's file, never one of the repository: the scorer sends its source on the command line, so a patch
cannot replace it. What it guarantees, and why (each is a way a patch was found to score 1 with the bug left in):

* **The repository cannot shadow the runner or the standard library.** `-I` keeps the working directory,
  `PYTHON*` variables and the user site out of `sys.path`; the repository is then put on `sys.path` after the
  standard library (and before site-packages, where a normal run would also find it first). A `unittest.py`
  or `argparse.py` the patch adds is never imported in place of the real one.
* **Results travel on a channel the code under test cannot print to.** Before any test is imported, stdout is
  moved to a private descriptor and fd 1 is pointed at stderr: whatever the tests or the code under test print
  lands in stderr (kept for people to read, never parsed). The verdict is one JSON line on the private
  descriptor, carrying a nonce the scorer sent on stdin, so a forged line (even one written to every
  descriptor) is not a verdict.
* **Exit status 0 iff every requested test ran and passed**, and the scorer requires both.
* **The test framework must not change while the tests run.** Every attribute of unittest's classes and of
  this runner's result class is fingerprinted before the first test module is imported and checked after each
  test: code under test that monkeypatches an assertion fails the run. This raises the cost of tampering with
  the interpreter it shares with the runner; it cannot rule it out (see docs/agent.md, "Scoring").

Stdlib only; nothing of slime is importable here.
"""

import json
import os
import sys
import unittest

EXIT_OK, EXIT_FAILED = 0, 1


def repository_path_first_after_stdlib(repo: str) -> None:
    """`sys.path` without the working directory, then `repo` right after the standard library's entries (the
    interpreter's zip, the stdlib and lib-dynload), before site-packages."""
    import sysconfig

    stdlib = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    sys.path[:] = [p for p in sys.path if p not in ("", ".", repo)]
    at = 0
    for i, p in enumerate(sys.path):
        in_stdlib = p.endswith(".zip") or any(p == d or p.startswith(d + os.sep) for d in stdlib)
        if in_stdlib and "-packages" not in p:
            at = i + 1
    sys.path.insert(at, repo)


def fingerprint(classes: list[type]) -> dict[str, int]:
    """Identity of every attribute of `classes` (a replaced method has another identity)."""
    out = {}
    for cls in classes:
        for k, v in vars(cls).items():
            out[f"{cls.__module__}.{cls.__qualname__}.{k}"] = id(v)
    return out


def framework_classes() -> list[type]:
    import unittest.case
    import unittest.loader
    import unittest.result
    import unittest.runner
    import unittest.suite

    mods = (unittest.case, unittest.loader, unittest.result, unittest.runner, unittest.suite)
    return [c for m in mods for c in vars(m).values() if isinstance(c, type) and c.__module__ == m.__name__]


class Recording(unittest.TextTestResult):
    """Outcome per test id, and a framework check after each test."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.outcomes: dict[str, str] = {}
        self.tampered: list[str] = []

    def _set(self, test: unittest.TestCase, outcome: str) -> None:
        tid = test.id()
        if self.outcomes.get(tid) in (None, "passed"):  # a failed sub-test fails its test
            self.outcomes[tid] = outcome

    def addSuccess(self, test):  # noqa: N802 - unittest's names
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._set(test, "failed")

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._set(test, "error")

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self._set(test, "skipped")

    def addExpectedFailure(self, test, err):  # noqa: N802
        super().addExpectedFailure(test, err)
        self._set(test, "expected failure")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._set(test, "unexpected success")

    def addSubTest(self, test, subtest, err):  # noqa: N802
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._set(test, "failed")

    def stopTest(self, test):  # noqa: N802
        super().stopTest(test)
        now = fingerprint(CHECKED)
        changed = sorted(k for k in set(BEFORE) | set(now) if BEFORE.get(k) != now.get(k))
        if changed:
            self.tampered += [f"{test.id()}: {k}" for k in changed]
            BEFORE.update(now)


def main(test_ids: list[str]) -> int:
    nonce = sys.stdin.readline().strip()
    channel = os.dup(1)  # the verdict's descriptor; not inherited by anything the tests start
    os.dup2(2, 1)  # from here on, anything printed goes to stderr
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    repository_path_first_after_stdlib(os.getcwd())
    outcomes: dict[str, str] = {}
    tampered: list[str] = []
    try:
        suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromName(t) for t in test_ids)
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Recording)
        result = runner.run(suite)
        outcomes, tampered = result.outcomes, result.tampered
    except BaseException as e:  # an import error of a test module is reported per test; this is anything else
        print(f"runner: {type(e).__name__}: {e}", file=sys.stderr)
    verdict = {t: outcomes.get(t, "not run") for t in test_ids}
    ok = bool(test_ids) and not tampered and all(v == "passed" for v in verdict.values())
    line = json.dumps({"nonce": nonce, "results": verdict, "tampered": tampered[:20]})
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the code under test: its output is not the verdict anyway
            pass
    os.write(channel, (line + "\n").encode())
    return EXIT_OK if ok else EXIT_FAILED


CHECKED = framework_classes() + [Recording]
BEFORE = fingerprint(CHECKED)

if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # no atexit hook of the code under test runs after the verdict
