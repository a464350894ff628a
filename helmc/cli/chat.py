"""`helmc chat`: a conversation with a bundle in the terminal, through the serving engine (one slot).

In a terminal: a banner naming the model and its plan, readline's line editing and a history kept across sessions
(~/.cache/helmc/chat_history), Ctrl-C stops the reply being written (not the program), Ctrl-D or /quit leaves.
Through a pipe: lines in, replies out, nothing else on stdout (the banner goes to stderr).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import click

from helmc.api import ChatOptions
from helmc.cli.options import weights_option
from helmc.cli.trust import plan_option, trust_options
from helmc.cli.extras import RUNTIME, need
from helmc.errors import HelmcError

_CHAT = ChatOptions()

COMMANDS = (("/help", "this list"), ("/reset", "forget the conversation (the system message stays)"),
            ("/stats", "the last reply's tokens, time to first token and decode rate"), ("/quit", "leave (or Ctrl-D)"))
HISTORY = os.path.join(os.path.expanduser("~"), ".cache", "helmc", "chat_history")


@click.command("chat")
@click.argument("bundle_dir", type=click.Path())
@click.option("--system", default=None, help="a system message at the start of the conversation")
@click.option("--max-new-tokens", type=int, default=_CHAT.max_new_tokens, show_default=True)
@click.option("--temperature", type=float, default=_CHAT.temperature, show_default=True, help="0 is greedy")
@click.option("--top-p", type=float, default=_CHAT.top_p, show_default=True)
@click.option("--top-k", type=int, default=_CHAT.top_k, show_default=True)
@click.option("--seed", type=int, default=_CHAT.seed)
@weights_option
@plan_option
@trust_options
def chat_command(bundle_dir, system, max_new_tokens, temperature, top_p, top_k, seed, weights_dir, plan_file, trust,
                 require_signed):
    """Chat with BUNDLE_DIR in the terminal: tokens print as they come; Ctrl-C stops a reply; /help lists the
    commands (/reset, /stats, /quit)."""
    from helmc import api
    api.runtime_only()
    need(*RUNTIME)
    options = ChatOptions(weights_dir=weights_dir, trust=tuple(trust), require_signed=require_signed, plan=plan_file,
                          max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed)                                 # its checks, before any loading
    conversation = api.chat(bundle_dir, options)
    Chat(conversation, system, bundle_dir).loop()


class Chat:
    def __init__(self, conversation, system, bundle_dir: str):
        self.conversation, self.engine = conversation, conversation.engine
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self.stats = "no reply yet"
        self.interactive = sys.stdin.isatty()
        self.bundle_dir = bundle_dir
        self._interrupted = False

    def loop(self) -> None:
        click.echo(self.banner(), err=True)
        if self.interactive:
            _readline_history()
        while True:
            try:
                line = input(">>> " if self.interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:              # at the prompt: a fresh line, as a shell does
                click.echo("")
                continue
            cmd = line.strip()
            if cmd == "/quit":
                break
            if not cmd:
                continue
            if cmd.startswith("/") and self.command(cmd):
                continue
            self.reply(line)

    def banner(self) -> str:
        model = self.engine.model
        plan, spec = model.session.plan, model.spec
        rate = f", about {plan.tokens_per_s:.1f} tok/s predicted" if plan.tokens_per_s else ""
        name = os.path.basename(os.path.normpath(self.bundle_dir))
        return (f"helmc chat: {name} ({spec.architecture}, {spec.num_layers} blocks); plan {plan.describe()}{rate}; "
                f"context {model.max_context} tokens\n/help lists the commands; Ctrl-C stops a reply, Ctrl-D leaves")

    def command(self, cmd: str) -> bool:
        """Run a /command; False for a line that only looks like one (sent to the model as text)."""
        if cmd == "/help":
            click.echo("\n".join(f"  {c:<8} {what}" for c, what in COMMANDS))
        elif cmd == "/reset":
            self.history = list(self.start)
            click.echo("[conversation cleared]")
        elif cmd == "/stats":
            click.echo(f"[{self.stats}]")
        elif not cmd.split()[0][1:].isalpha():        # "/etc/hosts?" is a question, not a command
            return False
        else:
            click.echo(f"[unknown command {cmd.split()[0]}; /help lists them]")
        return True

    def reply(self, line: str) -> None:
        self.history.append({"role": "user", "content": line})
        try:
            reply, last, stamps, t0 = [], [], [], time.perf_counter()

            def sink(c):
                stamps.append(time.perf_counter())
                reply.append(c.text)
                sys.stdout.write(c.text)
                sys.stdout.flush()
                if c.finish_reason:
                    last.append(c)
            request_id, prompt_tokens = self.conversation.submit(self.history, sink)
            stopped = self._run_until(lambda: bool(last), request_id)
        except HelmcError as e:
            self.history.pop()
            click.echo(f"helmc: error: {e} (/reset starts over)", err=True)
            return
        click.echo(" [stopped]" if stopped else "")
        if last and last[0].finish_reason == "error":
            self.history.pop()
            click.echo(f"helmc: error: {last[0].error}", err=True)
            return
        self.history.append({"role": "assistant", "content": "".join(reply)})
        n = last[0].completion_tokens if last else len(stamps)
        reason = last[0].finish_reason if last else "stopped by Ctrl-C"
        decode_s = stamps[-1] - stamps[0] if stamps else 0.0
        rate = (n - 1) / decode_s if decode_s > 0 else 0.0
        ttft = f"{1000 * (stamps[0] - t0):.1f} ms" if stamps else "-"
        self.stats = (f"{n} tokens ({reason}), prompt {prompt_tokens} tokens, TTFT {ttft}, decode {rate:.2f} tok/s, "
                      f"conversation {len(self.history)} messages")

    def _run_until(self, done, request_id: str) -> bool:
        """Step the engine until done(); Ctrl-C meanwhile cancels the request between two steps (never inside one:
        the KV caches stay whole). Returns whether it was stopped so."""
        self._interrupted = False
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            while not done():
                if self._interrupted:
                    self.engine.cancel(request_id)
                    self.engine.step()             # takes the cancellation: the slot and its pages go back
                    return True
                self.engine.step()
        finally:
            signal.signal(signal.SIGINT, previous)
        return False

    def _on_interrupt(self, signum, frame) -> None:
        self._interrupted = True


def _readline_history() -> None:
    """Line editing and a history kept across sessions (readline is in the standard library on Linux and macOS)."""
    try:
        import atexit
        import readline
    except ImportError:                            # no readline on this Python: plain input still works
        return
    readline.set_history_length(1000)
    try:
        readline.read_history_file(HISTORY)
    except OSError:
        pass

    def save():
        try:
            os.makedirs(os.path.dirname(HISTORY), exist_ok=True)
            readline.write_history_file(HISTORY)
        except OSError:
            pass
    atexit.register(save)
