"""A scripted coding-agent session, the long-horizon bench's load: its tools, prompt and turns.

Owns: the 11-tool list a coding agent sends on every call (about 28 KB of JSON, the size of
Claude Code's 11 tools), its system prompt, the ~450-character tool results, and the body of
turn ``i`` of session ``s`` in each dialect the bench speaks (``chat``, ``responses``,
``messages``), each re-sending the whole history. Never: sends anything (``trajgate.bench.horizon``
does) or parses an answer.

Turn ``i`` (``0 <= i < T``) sends the system prompt, the tools, the session's task, then ``i``
times the emulator's answer (its ``" t<id>"`` text for choice 0's ``response_tokens`` ids,
which is what the gateway returned) and a tool result. The emulator samples text, never a tool
call, so a tool result is a user turn (a ``tool_result`` block or a ``tool`` message needs a
tool call to answer); what the gateway stores and walks per call is the same size either way.
Written for this bench; the descriptions are generic, not any product's.
"""

from __future__ import annotations

import json
from typing import Any, Literal

Dialect = Literal["chat", "responses", "messages"]

SYSTEM_PROMPT = (
    "You are a coding agent working in a user's repository through the tools you are given. "
    "Read before you edit: open the files a change touches and the tests that cover them. Keep "
    "changes small and in the style of the surrounding code; never reformat what you did not "
    "change. Run the tests that cover your change and read their output before you say it "
    "works. When a command fails, read the error, state what you think went wrong, and try one "
    "fix at a time. Ask before deleting files, rewriting history or touching anything outside "
    "the repository. Prefer the dedicated tools over shell commands for reading, searching and "
    "editing files: they are faster and their output is easier to check. Keep a todo list for "
    "work of more than three steps and mark items done as you finish them. When you are done, "
    "say in two or three sentences what you changed, how you checked it, and what is left."
)

# (name, what it does, parameters: name -> (JSON type, description), required)
_TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    (
        "Bash",
        "Runs a shell command in a persistent session with an optional timeout and returns its "
        "standard output and error. Use it for builds, tests, git and package managers.",
        {
            "command": ("string", "The command to run, exactly as it would be typed."),
            "timeout_ms": ("integer", "Milliseconds before the command is stopped (max 600000)."),
            "description": ("string", "Five to ten words saying what the command does."),
        },
        ("command",),
    ),
    (
        "Read",
        "Reads a file from the local filesystem and returns its lines with line numbers. Reads "
        "up to 2000 lines from the start unless an offset and a limit are given.",
        {
            "file_path": ("string", "Absolute path of the file to read."),
            "offset": ("integer", "Line to start at (1-based)."),
            "limit": ("integer", "Number of lines to read."),
        },
        ("file_path",),
    ),
    (
        "Edit",
        "Replaces one exact occurrence of a string in a file with another string. Fails when "
        "the old string is missing or occurs more than once, unless replace_all is set.",
        {
            "file_path": ("string", "Absolute path of the file to modify."),
            "old_string": ("string", "The text to replace, exactly as in the file."),
            "new_string": ("string", "The text to put in its place."),
            "replace_all": ("boolean", "Replace every occurrence instead of exactly one."),
        },
        ("file_path", "old_string", "new_string"),
    ),
    (
        "MultiEdit",
        "Applies several exact string replacements to one file in order, all or none: when one "
        "edit fails, the file is left as it was.",
        {
            "file_path": ("string", "Absolute path of the file to modify."),
            "edits": ("array", "The edits, each with old_string, new_string and replace_all."),
        },
        ("file_path", "edits"),
    ),
    (
        "Write",
        "Writes a file to the local filesystem, replacing any file at that path. Read an "
        "existing file first; prefer Edit for changes to files that exist.",
        {
            "file_path": ("string", "Absolute path of the file to write."),
            "content": ("string", "The whole content of the file."),
        },
        ("file_path", "content"),
    ),
    (
        "Glob",
        "Finds files whose paths match a glob pattern such as src/**/*.py and returns them "
        "sorted by modification time, newest first.",
        {
            "pattern": ("string", "The glob pattern to match paths against."),
            "path": ("string", "Directory to search in; the working directory if omitted."),
        },
        ("pattern",),
    ),
    (
        "Grep",
        "Searches file contents with a regular expression and returns matching files, lines or "
        "counts. Supports file type and glob filters and context lines around each match.",
        {
            "pattern": ("string", "The regular expression to search for."),
            "path": ("string", "File or directory to search in."),
            "glob": ("string", "Only files whose paths match this glob."),
            "output_mode": ("string", "'content', 'files_with_matches' or 'count'."),
            "context_lines": ("integer", "Lines of context before and after each match."),
        },
        ("pattern",),
    ),
    (
        "LS",
        "Lists the files and directories directly under a path, with an optional list of glob "
        "patterns to leave out.",
        {
            "path": ("string", "Absolute path of the directory to list."),
            "ignore": ("array", "Glob patterns of entries to leave out."),
        },
        ("path",),
    ),
    (
        "WebFetch",
        "Fetches a URL, converts the page to markdown and answers a question about it with a "
        "small model. Read-only; results may be cached for a few minutes.",
        {
            "url": ("string", "The URL to fetch."),
            "prompt": ("string", "What to find out from the page."),
        },
        ("url", "prompt"),
    ),
    (
        "TodoWrite",
        "Replaces the session's todo list: each item has content, a status (pending, "
        "in_progress, completed) and an id. Use it to plan and track work of several steps.",
        {"todos": ("array", "The whole updated todo list.")},
        ("todos",),
    ),
    (
        "Task",
        "Starts a sub-agent with its own context on a self-contained task (a broad search, a "
        "review) and returns its final report. The sub-agent sees none of this conversation.",
        {
            "description": ("string", "Three to five words naming the task."),
            "prompt": ("string", "Everything the sub-agent needs to know to do the task."),
        },
        ("description", "prompt"),
    ),
)

# Usage notes appended to each description until it reaches its share of the list's size.
_NOTES = (
    "Use absolute paths; relative paths are resolved against the working directory, which "
    "may not be the one you expect after a cd.",
    "Prefer one call that does the whole job over several small ones: every call re-sends "
    "the conversation.",
    "Quote paths that contain spaces with double quotes.",
    "When the output is longer than 30000 characters it is cut, and the cut is marked.",
    "Never use this tool to read or write files outside the repository without asking.",
    "Explain in one sentence why you run it when the reason is not obvious from the context.",
    "Check the result before building on it: an empty answer is often a wrong path.",
    "Several independent calls can be made in one turn; they run in parallel.",
    "Do not retry the same failing call unchanged: read the error and change one thing.",
    "Results of earlier calls stay in the conversation; do not repeat a call to see them.",
    "Secrets in files or environment variables must never be printed or sent anywhere.",
    "Long-running commands should be given a timeout so the session is not blocked.",
)
TOOL_DESCRIPTION_CHARS = 2130  # each tool's description, so the list is about 28 KB of JSON


def _description(index: int, summary: str) -> str:
    text, note = summary + "\n\nUsage notes:", index
    while len(text) < TOOL_DESCRIPTION_CHARS:
        text += f"\n- {_NOTES[note % len(_NOTES)]}"
        note += 1
    return text[:TOOL_DESCRIPTION_CHARS]


def _schema(params: dict[str, tuple[str, str]], required: tuple[str, ...]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for name, (kind, description) in params.items():
        properties[name] = {"type": kind, "description": description}
        if kind == "array":
            properties[name]["items"] = {"type": "object"}
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def tools(dialect: Dialect) -> list[dict[str, Any]]:
    """The 11 tools in ``dialect``'s shape. Raises ``ValueError`` on an unknown dialect."""
    listed = []
    for index, (name, summary, params, required) in enumerate(_TOOLS):
        description, schema = _description(index, summary), _schema(params, required)
        if dialect == "chat":
            function = {"name": name, "description": description, "parameters": schema}
            listed.append({"type": "function", "function": function})
        elif dialect == "responses":
            listed.append(
                {"type": "function", "name": name, "description": description, "parameters": schema}
            )
        elif dialect == "messages":
            listed.append({"name": name, "description": description, "input_schema": schema})
        else:
            raise ValueError(f"dialect must be 'chat', 'responses' or 'messages', got {dialect!r}")
    return listed


def tool_list_bytes(dialect: Dialect) -> int:
    """Size of the tool list's JSON in ``dialect`` (bytes)."""
    return len(json.dumps(tools(dialect)).encode())


def task(session: int) -> str:
    """The first user turn of session ``session``."""
    return (
        f"Session {session}: the test tests/test_parser.py::test_nested_lists fails after the "
        "last refactor of src/parser.py. Find out why, fix it without changing the test, and "
        "run the parser's tests."
    )


def tool_result(session: int, turn: int, chars: int) -> str:
    """What a tool returned after turn ``turn`` of session ``session``: ``chars`` characters
    of test output, different per session and turn (so no two turns send equal text)."""
    lines = [f"$ python -m pytest tests/test_parser.py -q  # session {session}, turn {turn}"]
    case = 0
    while sum(len(line) + 1 for line in lines) < chars:
        lines.append(
            f"tests/test_parser.py::test_case_{turn}_{case} "
            f"{'PASSED' if (turn + case) % 3 else 'FAILED'} [{(case * 7) % 100:3d}%]"
        )
        case += 1
    return "\n".join(lines)[:chars]


def body(
    dialect: Dialect,
    session: int,
    turn: int,
    answer: str,
    *,
    stream: bool,
    response_tokens: int,
    tool_result_chars: int,
) -> dict[str, Any]:
    """Turn ``turn`` of session ``session`` in ``dialect`` (see the module docstring);
    ``answer`` is the emulator's answer text. Raises ``ValueError`` on an unknown dialect."""
    history: list[tuple[str, str]] = [("user", task(session))]
    for earlier in range(turn):
        history += [
            ("assistant", answer),
            ("user", tool_result(session, earlier, tool_result_chars)),
        ]
    common = {"model": "emulated", "temperature": 1.0, "stream": stream, "tools": tools(dialect)}
    if dialect == "chat":
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        messages += [{"role": role, "content": text} for role, text in history]
        return {**common, "messages": messages, "max_tokens": response_tokens}
    if dialect == "responses":
        return {
            **common,
            "instructions": SYSTEM_PROMPT,
            "input": [{"role": role, "content": text} for role, text in history],
            "max_output_tokens": response_tokens,
        }
    if dialect == "messages":
        return {
            **common,
            "system": SYSTEM_PROMPT,
            "messages": [{"role": role, "content": text} for role, text in history],
            "max_tokens": response_tokens,
        }
    raise ValueError(f"dialect must be 'chat', 'responses' or 'messages', got {dialect!r}")
