"""The tokenizer a gateway builds for this worker: GetTokenizer's archive (its files as a zip, for
a gateway on another host) and, with --chat-template, a directory of the same files for one on
this host. `--chat-template` rides in both as chat_template.jinja, the template it uses."""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import io
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 1 << 20
# what Hugging Face tokenizers are made of; weights and the rest of the model stay home
_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "chat_template.jinja", "chat_template.json", "generation_config.json", "config.json",
)  # fmt: skip
CHAT_TEMPLATE_NAME = "chat_template.jinja"


class TokenizerZip:
    """Built once, off the event loop, on first request; served from memory after that."""

    def __init__(self, tokenizer_dir: str, chat_template: str | None) -> None:
        self._dir = Path(tokenizer_dir)
        self._chat_template = Path(chat_template) if chat_template else None
        self._built: asyncio.Future[tuple[bytes, str]] | None = None
        self._copy: Path | None = None

    async def get(self) -> tuple[bytes, str]:
        """The archive and its SHA-256 hex digest."""
        if self._built is None:
            self._built = asyncio.ensure_future(asyncio.to_thread(self._build))
        return await asyncio.shield(self._built)

    def files(self) -> dict[str, Path]:
        """The archive's names and the files they are read from."""
        found = {name: self._dir / name for name in _FILES if (self._dir / name).is_file()}
        if self._chat_template is not None:
            found[CHAT_TEMPLATE_NAME] = self._chat_template
        return found

    def local_dir(self) -> str:
        """A directory holding exactly the archive's files: the tokenizer's own one, or with
        --chat-template a copy made once (its template is not in the tokenizer's)."""
        if self._chat_template is None:
            return str(self._dir)
        if self._copy is None:
            copy = Path(tempfile.mkdtemp(prefix="asyncengine-tokenizer-"))
            for name, path in self.files().items():
                shutil.copyfile(path, copy / name)
            self._copy = copy
            atexit.register(shutil.rmtree, copy, ignore_errors=True)
        return str(self._copy)

    def _build(self) -> tuple[bytes, str]:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, path in self.files().items():
                archive.write(path, name)
        data = buffer.getvalue()
        return data, hashlib.sha256(data).hexdigest()

    @staticmethod
    def chunks(data: bytes, digest: str) -> Iterator[common_pb2.GetTokenizerChunk]:
        """The archive in order, the digest on the last chunk only."""
        for start in range(0, len(data), CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(
                data=data[start:end], sha256=digest if end == len(data) else ""
            )
