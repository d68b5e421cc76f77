"""A server whose engine replays scripted output instead of running a model, for parser and protocol
tests: the user message carries `SCRIPT:{"text": ..., "cuts": [...], "finish": ...}` and the engine
emits that text in deltas cut at those offsets (or one character per delta with "chars": true),
"repeat" times over (default once); "echo_think_guard": true replies with the request's think_guard.

    python tests/scripted_server.py PORT TOKENIZER_DIR [--xml] [--tolerant] [--paused-reader-s S] [--max-http-clients N]
        [--log-requests PATH] [--end-in-thinking refuse|allow] [--keep-alive-s S]

--xml marks the chat template as a Qwen3-Coder one, so tool calls are parsed in the XML format;
--tolerant is the server's --tolerant-tool-calls."""
from __future__ import annotations

import json
import sys
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infernix_jax.engine import Event  # noqa: E402
from infernix_jax.tokenizer import Tokenizer  # noqa: E402
from server.app import ServerLimits, create_app  # noqa: E402

MARK = "SCRIPT:"


class ScriptedEngine:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.model_name = "scripted"
        self.max_context = 32768
        self.cfg = types.SimpleNamespace(vocab_size=tokenizer.tok.get_vocab_size(with_added_tokens=True))
        self.eos_ids = tuple(tokenizer.eos_ids)
        self.scheduler = types.SimpleNamespace(waiting=[], running=[])
        self.bm = types.SimpleNamespace(num_free=16, num_blocks=16)
        self.cache = None                    # no prefix cache
        self.spec = None                     # no speculative decoding

    def start(self, warmup: bool = True) -> None:
        pass

    def stop(self) -> None:
        pass

    def submit(self, req) -> None:
        threading.Thread(target=self._play, args=(req,), daemon=True).start()

    def _play(self, req) -> None:
        prompt = self.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)
        i = prompt.rfind(MARK)
        script, _ = json.JSONDecoder().raw_decode(prompt[i + len(MARK):]) if i >= 0 else ({"text": "ok"}, 0)
        text = script["text"]
        if script.get("echo_think_guard"):       # what the server asked of the engine
            text = f"think_guard={req.params.think_guard}"
        cuts = list(range(1, len(text))) if script.get("chars") else sorted(script.get("cuts", []))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] * script.get("repeat", 1)
        time.sleep(script.get("first_delay", 0))          # a long prefill
        for n, piece in enumerate(pieces):
            if req.cancelled.is_set():
                req.on_event(Event("done", finish_reason="abort", prompt_tokens=len(req.prompt_ids),
                                   completion_tokens=n))
                return
            req.on_event(Event("delta", text=piece, token_ids=(0,)))
            time.sleep(script.get("delay", 0))
        req.on_event(Event("done", finish_reason=script.get("finish", "stop"), prompt_tokens=len(req.prompt_ids),
                           completion_tokens=len(pieces)))


def main() -> None:
    port, tok_dir = int(sys.argv[1]), sys.argv[2]
    tok = Tokenizer.from_hf_dir(tok_dir)
    if "--xml" in sys.argv:
        tok.chat_template += "{# <tool_call><function=NAME> (Qwen3-Coder format) #}"
    def opt(name, default):
        return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default
    limits = ServerLimits(tolerant_tool_calls="--tolerant" in sys.argv, heartbeat_s=0.3,
                          paused_reader_s=opt("--paused-reader-s", 60.0), max_http_clients=opt("--max-http-clients", 64),
                          keep_alive_s=opt("--keep-alive-s", 360.0),
                          log_requests=opt("--log-requests", "") or None,
                          end_in_thinking=opt("--end-in-thinking", "refuse"),
                          model_names=("m", "scripted"))
    app = create_app(ScriptedEngine(tok), name="scripted", warmup=False, limits=limits)
    app.run(host="127.0.0.1", port=port, single_process=True, motd=False, access_log=False)


if __name__ == "__main__":
    main()
