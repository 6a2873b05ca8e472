"""The library never prints (issue 42, point 6): output goes through the CLI.

A module of builder/ outside builder/cli/ must not
- name `print` at all: no call, no parameter defaulting to it (`echo=print`), no `echo or print`: a library call
  says what it has to say through a callable its caller passes (`echo`, `on_note`; `builder.progress.quiet`, the
  default, says nothing) and the CLI passes its printer;
- touch sys.stdout or sys.stderr (or their `__stdout__`/`__stderr__` originals), other than to flush them: flushing
  writes nothing of ours, and a worker flushes what a library it hosts may have buffered before os._exit;
- write to file descriptor 1 or 2 (os.write(2, ...), open(1, ...)), nor print a traceback (traceback.print_*),
  nor configure logging's output (logging.basicConfig, a StreamHandler): that is the application's choice.

A child process's stdout can be its channel to the parent, not output to a user: builder/space/probe.py runs a
program (`python -I -S -c _CHILD`) whose stdout is a pipe the parent reads step by step. Such programs are
checked too (a string given after "-c" in an argument list, or the module-level string it names), and the ones
whose stdout is a protocol are allowed by name in CHILD_CHANNELS, each with its reason; any other child
program that writes fails. Code that only holds a stream for a child (`stdout=subprocess.PIPE`) names no stream
of this process and is not output.

What is left to fix is listed in PENDING (a folder or module, and who removes it); the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import builder

PKG = Path(builder.__file__).resolve().parent

# Child programs whose stdout is a channel to their parent, by (module, name of the string holding the program).
CHILD_CHANNELS = {
    ("space/probe.py", "_CHILD"): "the storage probe's child says each step as it begins and ends, one JSON line "
                                  "on its stdout, a pipe the parent reads with a deadline (a stuck step is named)",
}

# Still printing, each with who removes it (a folder or module: its reason); empty: the library prints nowhere.
PENDING: dict[str, str] = {}

STREAMS = {"stdout", "stderr", "__stdout__", "__stderr__"}
STD_FDS = (1, 2)
FD_WRITERS = {("os", "write"), ("os", "writev"), ("os", "fdopen"), ("io", "open"), (None, "open")}
PRINTERS = {("traceback", a) for a in ("print_exc", "print_exception", "print_stack", "print_tb", "print_last")}
PRINTERS |= {("pprint", "pprint"), ("pprint", "pp"), ("logging", "basicConfig"), ("logging", "StreamHandler")}


def _dotted(node: ast.expr) -> tuple[str | None, str] | None:
    """`os.write` -> ("os", "write"); `open` -> (None, "open")."""
    if isinstance(node, ast.Name):
        return None, node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def output_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of everything in `tree` that writes to this process's stdout or stderr, or could."""
    found = []
    flushed = {id(n.func.value) for n in ast.walk(tree)
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "flush"}
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "print":
            found.append((node.lineno, "print()" if id(node) in called else "print (a default, a fallback...)"))
        elif isinstance(node, ast.Attribute) and node.attr == "print":
            found.append((node.lineno, f"{ast.unparse(node)}"))
        elif (isinstance(node, ast.Attribute) and node.attr in STREAMS and isinstance(node.value, ast.Name)
              and node.value.id == "sys" and id(node) not in flushed):
            found.append((node.lineno, f"sys.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            found += [(node.lineno, f"from sys import {a.name}") for a in node.names if a.name in STREAMS]
        elif isinstance(node, ast.Call) and (name := _dotted(node.func)) is not None:
            if name in PRINTERS:
                found.append((node.lineno, ".".join(filter(None, name))))
            elif (name in FD_WRITERS and node.args and isinstance(node.args[0], ast.Constant)
                  and node.args[0].value in STD_FDS):
                found.append((node.lineno, f"{'.'.join(filter(None, name))}({node.args[0].value}, ...)"))
    return found


def child_programs(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(name, line, source) of each program this module gives a child Python (`-c PROGRAM` in an argument list):
    a string literal (name "") or a module-level string it names."""
    strings = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
               for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List | ast.Tuple):
            continue
        for flag, arg in zip(node.elts, node.elts[1:], strict=False):
            if not (isinstance(flag, ast.Constant) and flag.value == "-c"):
                continue
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(("", arg.lineno, arg.value))
            elif isinstance(arg, ast.Name) and arg.id in strings:
                found.append((arg.id, arg.lineno, strings[arg.id]))
    return found


def offences(rel: str, source: str) -> list[str]:
    """Every place where module `rel` (a path under builder/) prints, its children's allowed channels aside."""
    tree = ast.parse(source, rel)
    found = [f"{rel}:{line}: {what}" for line, what in output_in(tree)]
    for name, line, program in child_programs(tree):
        if (rel, name) not in CHILD_CHANNELS:
            found += [f"{rel}:{line}: the child program {name or '(a literal)'} writes: {what}"
                      for _, what in output_in(ast.parse(program))]
    return found


def library_modules() -> list[str]:
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                  if p.relative_to(PKG).parts[0] != "cli" and "_schema" not in p.parts)


def pending(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in PENDING)


def test_no_library_module_prints():
    found = [o for rel in library_modules() for o in offences(rel, (PKG / rel).read_text())
             if not pending(rel) or o.endswith(": print()")]
    assert not found, ("the library prints (pass what it says to an `echo` its caller gives; the CLI prints):\n"
                       + "\n".join(found))


def test_the_pending_list_names_modules_that_still_print():
    """A pending entry that prints no more is dropped, not left to excuse a later one."""
    for entry in PENDING:
        mods = [rel for rel in library_modules() if rel == entry or rel.startswith(entry)]
        assert mods, f"PENDING names {entry}, which holds no module"
        assert any(offences(rel, (PKG / rel).read_text()) for rel in mods), f"{entry} prints no more: drop it"


def test_each_allowed_child_channel_is_a_child_program_that_writes():
    """An allowed channel that is gone (or writes no more) is dropped, not left to excuse a later one."""
    for rel, name in CHILD_CHANNELS:
        programs = {n: src for n, _, src in child_programs(ast.parse((PKG / rel).read_text()))}
        assert name in programs, f"{rel} runs no child program {name}: drop it from CHILD_CHANNELS"
        assert output_in(ast.parse(programs[name])), f"{rel}'s {name} writes nothing: drop it from CHILD_CHANNELS"


def test_the_rule_catches_each_way_of_printing():
    """The rule itself: each way a module could print is caught; flushing, a child's pipe and a file are not."""
    def caught(src: str, rel: str = "x.py") -> bool:
        return bool(offences(rel, src))

    assert offences("run/x.py", "print('x')") == ["run/x.py:1: print()"]  # refused in PENDING's modules too
    assert caught("print('x')") and caught("def f(echo=print): pass") and caught("say = echo or print")
    assert caught("class O:\n    echo: object = print") and caught("import builtins\nbuiltins.print('x')")
    assert caught("import sys\nsys.stderr.write('x')") and caught("import sys\nout = sys.stdout")
    assert caught("import sys\nsys.__stderr__.write('x')") and caught("from sys import stderr")
    assert caught("import sys\nprint_to(sys.stderr)") and caught("import os\nos.write(2, b'x')")
    assert caught("import os\nos.fdopen(1, 'w')") and caught("open(2, 'w')")
    assert caught("import traceback\ntraceback.print_exc()") and caught("import logging\nlogging.basicConfig()")
    assert caught("import sys, subprocess\nsubprocess.run([sys.executable, '-c', 'print(1)'])")
    child = "import subprocess, sys\nP = 'import sys\\nsys.stdout.write(1)'\nsubprocess.run([sys.executable, '-c', P])"
    assert caught(child) and not caught(child.replace("P", "_CHILD"), "space/probe.py")

    assert not caught("import sys\nsys.stdout.flush()\nsys.stderr.flush()")
    assert not caught("import os\nos.write(fd, b'x')") and not caught("open(path, 'w').write('x')")
    assert not caught("import subprocess\nsubprocess.run(['ls'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)")
    assert not caught('"""Implementations never print."""') and not caught("fingerprint(x)")
