"""The tokenizer of a GGUF file as a Hugging Face `tokenizers` tokenizer (byte-level BPE: qwen2, llama-bpe, gpt-2
pre-tokenizers), with its chat template."""
from __future__ import annotations

from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.model.gguf_spec import field_value, open_gguf_reader


@dataclass(frozen=True)
class _PreTokenizer:
    regex: str | None         # the Split regex of the model's tokenizer.json; None: GPT-2's, inside ByteLevel
    nfc: bool                 # Qwen2's tokenizer.json normalizes to NFC
    ignore_merges: bool       # Llama 3: a word already in the vocab is one token, whatever the merges say
    add_bos: bool             # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


# The original regexes of the models' tokenizer.json (llama-vocab.cpp quotes them next to its own rewrites):
# Qwen2 splits digits one by one, Llama 3 in groups of up to three.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_LLAMA3 = _PreTokenizer(_SPLIT % "{1,3}", nfc=False, ignore_merges=True, add_bos=True)
PRE_TOKENIZERS = {"qwen2": _PreTokenizer(_SPLIT % "", nfc=True, ignore_merges=False, add_bos=False),
                  "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
                  "gpt-2": _PreTokenizer(None, nfc=False, ignore_merges=False, add_bos=False)}
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED = 1, 2, 3, 4, 5   # gguf.TokenType


def read_gguf_tokenizer(path: str) -> tuple[str, str | None]:
    """(tokenizer.json text for the `tokenizers` library, chat template or None) of a GGUF's byte-level BPE.

    The token list gives the ids (UNUSED padding entries are left out of the vocabulary; their ids stay
    unused), the merges their ranks, tokenizer.ggml.pre the pre-tokenizer, CONTROL / USER_DEFINED token
    types the special / added tokens, matched before BPE as Hugging Face does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    reader = open_gguf_reader(path)

    def get(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field_value(field)

    kind = get("tokenizer.ggml.model")
    if kind is None:
        raise HelmcError(f"{path}: no tokenizer: key 'tokenizer.ggml.model' missing (pass token ids instead of text)")
    if kind != "gpt2":
        raise HelmcError(f"{path}: tokenizer.ggml.model expected 'gpt2' (byte-level BPE), found {kind!r}" + (
            " (a SentencePiece vocabulary, not supported yet: use the model's tokenizer.json or pass token ids)"
            if kind == "llama" else ""))
    pre_name = get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise HelmcError(f"{path}: tokenizer.ggml.pre expected one of {', '.join(PRE_TOKENIZERS)}, found {pre_name!r}")
    pre = PRE_TOKENIZERS[pre_name]
    tokens = get("tokenizer.ggml.tokens") or []
    types = get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    merges = get("tokenizer.ggml.merges") or []
    if not tokens or len(types) != len(tokens):
        raise HelmcError(f"{path}: tokenizer: expected a token list and one type per token, found "
                         f"{len(tokens)} tokens and {len(types)} types")

    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty != _UNUSED:
            vocab.setdefault(t, i)
    bad = next((m for m in merges if " " not in m), None)     # byte-level tokens hold no space: 'left right'
    if bad is not None:
        raise HelmcError(f"{path}: tokenizer.ggml.merges: expected 'left right' entries, found {bad!r}")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges, byte_fallback=False))
    except Exception as e:          # tokenizers raises a bare Exception for a merge outside the vocabulary
        raise HelmcError(f"{path}: tokenizer: expected merges of tokens in the list, found {e}") from None
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=pre.regex is None)
    tok.pre_tokenizer = byte_level if pre.regex is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pre.regex), behavior="isolated", invert=False), byte_level])
    tok.decoder = decoders.ByteLevel()
    # Added tokens already in the vocabulary keep their ids (add_tokens looks them up first).
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty in (_CONTROL, _UNKNOWN)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == _USER_DEFINED])
    for i, ty in enumerate(types):
        if ty in (_CONTROL, _UNKNOWN, _USER_DEFINED) and tok.token_to_id(tokens[i]) != i:
            raise HelmcError(f"{path}: tokenizer: token {tokens[i]!r} is listed at id {i} and again at "
                             f"{tok.token_to_id(tokens[i])}; expected each special token once")
    tok.post_processor = _post_processor(path, get, tokens, pre, processors)
    return tok.to_str(), get("tokenizer.chat_template")


def _post_processor(path, get, tokens, pre: _PreTokenizer, processors):
    """BOS / EOS added to an encoded text as llama.cpp adds them (tokenizer.ggml.add_bos_token / add_eos_token)."""
    ends = []
    for which, default in (("bos", pre.add_bos), ("eos", False)):
        tid = get(f"tokenizer.ggml.{which}_token_id")
        if not get(f"tokenizer.ggml.add_{which}_token", default):
            continue
        if not isinstance(tid, int) or not 0 <= tid < len(tokens):
            raise HelmcError(f"{path}: tokenizer.ggml.add_{which}_token is set; expected tokenizer.ggml.{which}_token_id "
                             f"below {len(tokens)}, found {tid!r}")
        ends.append((which, tokens[tid], tid))
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not ends:
        return byte_level
    bos, eos = [t for w, t, _ in ends if w == "bos"], [t for w, t, _ in ends if w == "eos"]
    single = [f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[(t, i) for _, t, i in ends])
    return processors.Sequence([byte_level, template])
