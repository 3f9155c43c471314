"""The synthetic tasks behind the demo model's training conversations (`demo_data`).

A task is one user request and what answers it: list the files, read a file, run a shell
command, write a file, or a chat message with no tool. Tool outputs are made up here (file
names, contents, command output) and the final answer quotes them, so the model learns to copy
what a tool returned rather than to recall it. Every choice comes from the caller's `rng`;
`version` is the data version (`demo_data.DATA_VERSIONS`): v5's draws are kept as they were.

Data v6's paths have random parts (`working_dir`, `_name`): mkdtemp-like working directories
(`/tmp/tmp` + 8 of tempfile's characters, what `tempfile.mkdtemp()` makes), random alphanumeric
project and user names beside the word lists, random file stems. A path in a call can then
only be copied from the prompt (v5's held-out working directories occurred verbatim in its
training data 27% of the time), and the 1-3 character BPE pieces such names split into are all
trained (48% of the tokens of real mkdtemp paths were ids v5 never saw).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

_WORDS = [
    "alpha", "beta", "gamma", "delta", "cache", "route", "token", "model", "server",
    "agent", "proxy", "queue", "worker", "index", "parser", "config", "report",
    "upload", "image", "table", "graph", "batch", "stream", "vector", "sample",
    "client", "kernel", "layer", "expert", "anchor", "buffer", "socket", "schema",
    "record", "branch", "commit", "notes", "todo", "draft", "plan", "budget", "lunch",
    "garden", "music", "river", "orange", "planet", "rocket",
    "apple", "bridge", "candle", "desert", "engine", "forest", "harbor", "island", "jungle",
    "ladder", "magnet", "needle", "ocean", "pepper", "quartz", "ribbon", "silver", "tunnel",
    "velvet", "window", "yellow", "zipper", "atlas", "bloom", "cedar", "ember", "falcon",
    "glider", "hollow", "ivory", "jasper", "kettle", "lemon", "maple", "nectar", "opal",
    "pixel", "quill", "raven", "saddle", "timber", "umbra", "vortex", "walnut", "yarrow",
    "zephyr", "auth", "login", "users", "orders", "billing", "search", "metrics", "logger",
    "storage", "payment", "invoice", "session", "profile", "widget", "sensor", "monitor",
    "export", "import", "backup", "deploy", "runner", "helper", "common", "shared", "core",
]
# working directories: drawn from many, so a path in a call can only come from the prompt's own
_USERS = ["dev", "sam", "li", "kim", "ana", "omar", "jo", "priya", "max", "eve", "noah", "mia",
          "leo", "zoe", "ivan", "aiko", "ben", "chen", "dana", "emil", "fatima", "gus"]
_ROOTS = ["/home/{u}/{p}", "/home/{u}/code/{p}", "/home/{u}/src/{p}", "/work/{p}", "/srv/{p}",
          "/tmp/{p}", "/root/{p}", "/Users/{u}/{p}", "/opt/{p}", "/home/{u}/projects/{p}"]
_COMMON = ["README.md", "main.py", "setup.py", "pyproject.toml", "Makefile", "LICENSE",
           "package.json", "index.js", "app.py", "notes.txt", "TODO.md", "config.yaml",
           "requirements.txt", "Cargo.toml", "go.mod", "CHANGELOG.md", "Dockerfile",
           "utils.py", "server.js", "data.csv"]
_DIRS = ["src", "tests", "docs", "scripts", "lib", "data", "assets", "bin", "examples"]
_EXTS = [".py", ".md", ".txt", ".js", ".json", ".toml", ".sh", ".rs", ".go", ".yaml"]
_SENT = ["This project {v} {o}.", "It {v} {o} for the {a} team.", "Run make to {v2} it.",
         "The {a} module {v} {o}.", "See docs for how to {v2} the {a} {n}.",
         "Version {d}.{d}.{d}.", "Author: {name}.", "TODO: {v2} the {a} {n}."]
_V = ["builds", "serves", "tests", "parses", "stores", "tracks", "renders", "checks"]
_V2 = ["build", "install", "run", "test", "deploy", "configure", "clean"]
_NAMES = ["Ana", "Sam", "Li Wei", "Kim", "Omar", "Jo", "Priya", "Max"]

LIST_ASKS = ["list the files", "List the files.", "list the files here", "What files are here?",
             "what files are in this directory?", "Show me the files.", "ls",
             "Which files does this project have?", "list files", "show the directory contents",
             "What is in this folder?", "list the files in the current directory"]
LIST_DIR_ASKS = ["list the files in {d}", "What files are in {d}?", "ls {d}",
                 "show me what is in {d}/", "List the contents of {d}.", "what's inside {d}"]
READ_ASKS = ["what does {f} say", "What does {f} say?", "read {f}", "Read {f}.",
             "show me {f}", "cat {f}", "What's in {f}?", "open {f}", "print {f}",
             "Can you read {f} for me?", "what is in {f}", "Show the contents of {f}."]
SHELL_ASKS = ["run `{c}`", "Run {c}", "run {c}", "What does `{c}` print?", "execute `{c}`",
              "Please run `{c}` and tell me the output.", "$ {c}"]
WRITE_ASKS = ["create a file {f} containing {t}", "Write \"{t}\" to {f}.",
              "make a file called {f} with the text {t}", "write {t} into {f}",
              "Create {f} with the content: {t}"]
CHATS = [("hi", "Hello! How can I help you with this project?"),
         ("Hi!", "Hello! How can I help you with this project?"),
         ("hello", "Hello! How can I help you with this project?"),
         ("hey", "Hello! How can I help you with this project?"),
         ("thanks", "You're welcome!"), ("Thank you!", "You're welcome!"),
         ("who are you?", ("I am the FreeToken demo model, a tiny model trained to list, read "
          "and write files and run shell commands.")),
         ("what can you do?", ("I can list the files, read a file, write a file and run a "
          "shell command, then tell you what came back.")),
         ("ok", "Okay. Tell me what you need next."),
         ("bye", "Goodbye!")]


@dataclass
class Turn:
    """One assistant turn: a tool call (`call`; `command` set for mini's finishing command, which
    gets no result) or a text answer."""

    call: bool
    text: str = ""
    command: str | None = None


@dataclass
class Task:
    kind: str  # list | read | shell | write | chat
    request: str
    path: str = ""
    content: str = ""
    command: str = ""
    description: str = ""
    output: str = ""
    answer: str = ""
    thought: str = field(default="")
    # v6: a harness whose read tool takes an absolute path (Claude Code's Read) reads with
    # `cat` in its shell instead: relative to the shell's working directory, so a tiny model
    # never has to copy the directory for a read (v5's Claude Code failures were all reads of
    # a made-up directory); writes keep the absolute path, which v6's random dirs teach
    read_by_shell: bool = False

    def turns(self, mini: bool, done: str) -> list[Turn]:
        if self.kind == "chat":
            return [Turn(False, self.answer)]
        first = Turn(True, self.thought if mini else "")
        last = Turn(True, self.answer, done) if mini else Turn(False, self.answer)
        return [first, last]


TMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile's names draw from these
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
_ROOTS6 = _ROOTS + ["/var/tmp/{p}", "/home/{u}/work/{p}", "/home/{u}/git/{p}", "/mnt/data/{p}",
                    "/Users/{u}/code/{p}", "/Users/{u}/Desktop/{p}", "/data/{u}/{p}"]


def random_part(rng: random.Random, lo: int, hi: int, chars: str = TMP_CHARS) -> str:
    return "".join(rng.choice(chars) for _ in range(rng.randint(lo, hi)))


def mkdtemp_like(rng: random.Random) -> str:
    """What `tempfile.mkdtemp()` returns on Linux: /tmp/tmp + 8 random characters."""
    return "/tmp/tmp" + "".join(rng.choice(TMP_CHARS) for _ in range(8))


def _stem6(rng: random.Random) -> str:
    """A v6 name: random (45%), a word and a random part (25%), or words as in v5."""
    k = rng.random()
    if k < 0.45:
        return random_part(rng, 2, 10)
    if k < 0.7:
        return rng.choice(_WORDS) + rng.choice("_-") + random_part(rng, 1, 6, _ALNUM)
    return rng.choice(_WORDS) + rng.choice(["", "_" + rng.choice(_WORDS), str(rng.randint(1, 99))])


def _name(rng: random.Random, version: int = 5) -> str:
    if version >= 6:
        return rng.choice(_COMMON) if rng.random() < 0.2 else _stem6(rng) + rng.choice(_EXTS)
    if rng.random() < 0.25:
        return rng.choice(_COMMON)
    stem = rng.choice(_WORDS) + rng.choice(["", "_" + rng.choice(_WORDS), "-" + rng.choice(
        _WORDS), str(rng.randint(1, 99))])
    return stem + rng.choice(_EXTS)


def working_dir(rng: random.Random, version: int = 5) -> str:
    """A working directory (the recorded harness prompt states it): v5 from thousands of
    word-list names; v6 mkdtemp-like (40%) or a root with a random or word-and-random project
    and a random or listed user, from billions."""
    if version >= 6:
        if rng.random() < 0.4:
            return mkdtemp_like(rng)
        user = rng.choice(_USERS) if rng.random() < 0.4 else random_part(rng, 2, 8, _ALNUM)
        k = rng.random()
        project = (random_part(rng, 3, 12, _ALNUM + "_-") if k < 0.5 else _stem6(rng))
        if rng.random() < 0.15:
            project = project.capitalize()
        return rng.choice(_ROOTS6).format(u=user, p=project)
    project = rng.choice(_WORDS) + rng.choice(["", "", "-" + rng.choice(_WORDS),
                                               str(rng.randint(2, 9))])
    return rng.choice(_ROOTS).format(u=rng.choice(_USERS), p=project)


def _sentence(rng: random.Random) -> str:
    return rng.choice(_SENT).format(
        v=rng.choice(_V), v2=rng.choice(_V2), o=" ".join(rng.sample(_WORDS, 2)),
        a=rng.choice(_WORDS), n=rng.choice(_WORDS), d=rng.randint(0, 9), name=rng.choice(_NAMES))


def _file_text(rng: random.Random, path: str, corpus: list[str]) -> str:
    """A few lines: made-up sentences, or lines of real text (`corpus`, from the recorded
    prompts), so the answers learn to copy any text and not just our word list."""
    lines = [rng.choice(corpus) if corpus and rng.random() < 0.5 else _sentence(rng)
             for _ in range(rng.randint(1, 4))]
    if path.endswith(".md") or rng.random() < 0.3:
        lines = [f"# {rng.choice(_WORDS).title()} {rng.choice(_WORDS)}", ""] + lines
    return "\n".join(lines)


def _quote(text: str, n: int = 3) -> str:
    """The first `n` non-empty lines: what a final answer quotes of a tool's output."""
    return "\n".join([ln for ln in text.split("\n") if ln.strip()][:n])


def _listing(rng: random.Random, v: int) -> list[str]:
    names = {_name(rng, v) for _ in range(rng.randint(1, 7))}
    names |= set(rng.sample(_DIRS, rng.randint(0, 3)))
    if rng.random() < 0.6:
        names.add("README.md")
    return sorted(names)


def _shell(rng: random.Random, v: int) -> tuple[str, str, str]:
    """(command, description, output)"""
    k = rng.randrange(6)
    if k == 0:
        w = " ".join(rng.sample(_WORDS, rng.randint(1, 3)))
        return f"echo {w}", "Print text", w + "\n"
    if k == 1:
        f = _name(rng, v)
        n = rng.randint(1, 400)
        return f"wc -l {f}", "Count lines", f"{n} {f}\n"
    if k == 2:
        branch = rng.choice(["main", "master", "dev", "feature/" + rng.choice(_WORDS)])
        files = [_name(rng, v) for _ in range(rng.randint(0, 2))]
        body = "".join(f"\tmodified:   {f}\n" for f in files)
        out = f"On branch {branch}\n" + (f"Changes not staged for commit:\n{body}" if files
                                         else "nothing to commit, working tree clean\n")
        return "git status", "Show working tree status", out
    if k == 3:
        v = f"3.{rng.randint(8, 13)}.{rng.randint(0, 12)}"
        return "python3 --version", "Show Python version", f"Python {v}\n"
    if k == 4:
        day = rng.choice(["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"])
        out = f"{day} Dec {rng.randint(1, 28)} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return "date", "Show the date", out + ":00 UTC 2026\n"
    h = "".join(rng.choice("0123456789abcdef") for _ in range(7))
    msg = f"{rng.choice(_V2)} {rng.choice(_WORDS)}"
    return "git log --oneline -n 1", "Show the last commit", f"{h} {msg}\n"


def make_task(rng: random.Random, mini: bool, corpus: list[str] | None = None,
              version: int = 5) -> Task:
    """One task of data `version`; `mini` tasks always use a tool (mini-swe-agent needs a
    command every turn)."""
    v = version
    kinds = ["list", "read", "read", "shell", "write"] + ([] if mini else ["chat"])
    kind = rng.choice(kinds)
    if kind == "chat":
        ask, answer = rng.choice(CHATS)
        return Task("chat", ask, answer=answer)
    if kind == "list":
        names = _listing(rng, v)
        out = "".join(n + "\n" for n in names)
        if rng.random() < 0.35:  # a subdirectory, named in the request: copied into the call
            d = (random_part(rng, 2, 8) if v >= 6 and rng.random() < 0.3
                 else rng.choice(_DIRS + _WORDS))
            return Task("list", rng.choice(LIST_DIR_ASKS).format(d=d), path=d, command=f"ls {d}",
                        description=f"List files in {d}", output=out,
                        answer=f"The files in {d} are: " + ", ".join(names) + ".",
                        thought=f"I will list the files in {d}.")
        return Task("list", rng.choice(LIST_ASKS), command="ls",
                    description="List files in current directory", output=out,
                    answer="The files here are: " + ", ".join(names) + ".",
                    thought="I will list the files in the current directory.")
    if kind == "read":
        # README.md now and then only: a model that always reads it must not score
        path = "README.md" if rng.random() < 0.15 else _name(rng, v)
        if rng.random() < 0.25:
            path = f"{rng.choice(_DIRS)}/{_name(rng, v)}"
        ask = rng.choice(READ_ASKS)
        if path == "README.md" and rng.random() < 0.3:
            ask = ask.replace("{f}", "README")
        text = _file_text(rng, path, corpus or [])
        return Task("read", ask.format(f=path), path=path, command=f"cat {path}",
                    description=f"Show {path}", output=text + "\n",
                    answer=f"{path} says:\n\n{_quote(text)}",
                    thought=f"I will read {path}.", read_by_shell=v >= 6)
    if kind == "shell":
        cmd, desc, out = _shell(rng, v)
        return Task("shell", rng.choice(SHELL_ASKS).format(c=cmd), command=cmd,
                    description=desc, output=out,
                    answer=f"`{cmd}` printed:\n\n{_quote(out)}",
                    thought=f"I will run `{cmd}`.")
    path = _name(rng, v)
    text = " ".join(rng.sample(_WORDS, rng.randint(1, 4)))
    return Task("write", rng.choice(WRITE_ASKS).format(f=path, t=text), path=path,
                content=text + "\n", command=f"printf '%s\\n' '{text}' > {path}",
                description=f"Write {path}", output="",
                answer=f"I wrote {path}.", thought=f"I will write {path}.")
