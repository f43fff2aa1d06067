"""`mola chat`: an interactive chat with a mola server, switching model ids and
adapter strength mid-conversation.

    session.py   the conversation: messages, the model id, lora_scale, the system prompt, /save
    client.py    the server's OpenAI-compatible API over httpx: streamed answers, the model list
    local.py     `mola chat --model ...`: a `mola serve` of its own on 127.0.0.1, stopped on exit
    repl.py      the loop a person types in: readline editing and history, commands, Ctrl-C, Ctrl-D
"""

from .client import ChatClient, ServerError
from .repl import run_chat
from .session import Session

__all__ = ["ChatClient", "ServerError", "Session", "run_chat"]
