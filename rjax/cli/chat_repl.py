"""`rjax chat` in the terminal: line editing and history (the standard library's readline),
slash commands, and Ctrl-C that stops a reply without ending the conversation.

Ctrl-C during a reply stops it; the reply is kept as far as it was shown (rjax.runtime.chat). Ctrl-C at
the prompt leaves with status 130, Ctrl-D (end of input) or /exit with 0.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rjax.math.sampling import check_sampling
from rjax.runtime.chat import ChatSession

HELP = """\
/help                   this list
/set                    show the settings
/set temperature T      sampling temperature (0: greedy)
/set top_p P            nucleus sampling (1: off)
/set top_k K            top-k sampling (0: off)
/set max_tokens N       the most tokens a reply may have
/set system TEXT        the system prompt (/set system with no text removes it)
/reset                  start the conversation over
/save FILE              write the conversation to FILE as JSON
/load FILE              read a conversation written by /save
/exit, /quit            leave (as Ctrl-D does)
Ctrl-C stops a reply (what was shown is kept); Ctrl-C at the prompt leaves."""

ROLES = ("system", "user", "assistant")


class CommandError(ValueError):
    """A slash command that cannot be done: the session is left as it was."""


def set_option(session: ChatSession, name: str, value: str) -> None:
    """One `/set NAME VALUE`, checked before anything changes."""
    if name == "system":
        messages = [m for m in session.messages if m["role"] != "system"]
        session.system = value or None
        session.messages = ([{"role": "system", "content": value}] if value else []) + messages
        return
    numbers = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int}
    if name not in numbers:
        raise CommandError(f"/set {name}: unknown setting; one of {', '.join([*numbers, 'system'])}")
    try:
        number = numbers[name](value)
    except ValueError:
        raise CommandError(f"/set {name}: {value!r} is not {'an integer' if numbers[name] is int else 'a number'}") \
            from None
    if name == "max_tokens":
        if number < 1:
            raise CommandError(f"/set max_tokens: must be >= 1, got {number}")
        session.max_new_tokens = number
        return
    settings = dict(temperature=session.temperature, top_k=session.top_k, top_p=session.top_p)
    settings[name] = number
    try:
        check_sampling(settings["temperature"], settings["top_k"], settings["top_p"])
    except ValueError as e:
        raise CommandError(f"/set {name}: {e}") from None
    session.temperature, session.top_k, session.top_p = settings["temperature"], settings["top_k"], settings["top_p"]


def settings_line(session: ChatSession) -> str:
    return (f"temperature {session.temperature}, top_p {session.top_p}, top_k {session.top_k}, "
            f"max_tokens {session.max_new_tokens}, system {session.system!r}")


def save(session: ChatSession, path: str) -> None:
    try:
        Path(path).write_text(json.dumps({"model": session.model.name, "messages": session.messages},
                                         indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise CommandError(f"/save: cannot write {path}: {e.strerror or e}") from None


def load(session: ChatSession, path: str) -> ChatSession:
    """The session with the conversation of `path` (written by /save), its cache empty."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise CommandError(f"/load: cannot read {path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CommandError(f"/load: {path} is not JSON: {e}") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        raise CommandError(f"/load: {path} has no \"messages\" list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise CommandError(f"/load: {path}: messages[{i}] is not {{\"role\": one of {', '.join(ROLES)}, "
                               f"\"content\": text}}")
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    loaded = session.reset()
    loaded.messages, loaded.system = [dict(role=m["role"], content=m["content"]) for m in messages], system
    return loaded


def command(session: ChatSession, line: str) -> tuple[ChatSession, str | None, bool]:
    """A slash command -> (the session, a line to show or None, whether to leave)."""
    name, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    if name in ("/exit", "/quit", "/bye"):
        return session, None, True
    if name in ("/help", "/?"):
        return session, HELP, False
    if name == "/reset":
        return session.reset(), "the conversation starts over", False
    if name == "/set":
        if not rest:
            return session, settings_line(session), False
        option, _, value = rest.partition(" ")
        set_option(session, option, value.strip())
        return session, settings_line(session), False
    if name in ("/save", "/load"):
        if not rest:
            raise CommandError(f"{name} needs a file name")
        if name == "/save":
            save(session, rest)
            return session, f"saved {len(session.messages)} messages to {rest}", False
        session = load(session, rest)
        return session, f"loaded {len(session.messages)} messages from {rest}", False
    raise CommandError(f"unknown command {name}; /help lists the commands")


def _readline(history: Path | None) -> None:
    """Line editing and history for input(), where the terminal has them."""
    if not sys.stdin.isatty():
        return
    try:
        import readline
    except ImportError:  # a Python built without it: plain input
        return
    if history is None:
        return
    import atexit

    try:
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(1000)
    atexit.register(lambda: _write_history(readline, history))


def _write_history(readline, history: Path) -> None:
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(history)
    except OSError:
        pass


def run(session: ChatSession, history: Path | None = None) -> int:
    """The conversation loop -> the exit status."""
    _readline(history)
    print(f"chatting with {session.model.name} (/help for commands, Ctrl-D or /exit to leave)", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        if not line.strip():
            continue
        if line.lstrip().startswith("/"):
            try:
                session, message, leave = command(session, line)
            except CommandError as e:
                message, leave = f"rjax: {e}", False
            if message:
                print(message, file=sys.stderr)
            if leave:
                return 0
            continue
        reply = session.send(line)
        try:
            for chunk in reply:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        except KeyboardInterrupt:
            reply.close()
            sys.stdout.write("\n")
            print("[interrupted: the reply is kept as far as it was shown]", file=sys.stderr)
            continue
        except ValueError as e:  # a refused turn (too long for the context, ...): the session is as it was
            print(f"rjax: error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if session.speculative_counts:
            s = session.speculative_counts
            print(f"[speculative: {s['accepted']} of {s['drafted']} drafted tokens accepted in {s['steps']} steps]",
                  file=sys.stderr)
