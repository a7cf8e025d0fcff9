"""dataset=text: your own text files."""
from __future__ import annotations

from posbench.data.base import register
from posbench.data.corpus import TextCorpus
from posbench.data.documents import Documents, files_documents, local_files
from posbench.core.errors import require


@register("text", "your own text files: dataset.path=FILE|FOLDER|GLOB, each file one document")
class Text(TextCorpus):
    @classmethod
    def check(cls, cfg, run_cfg) -> None:
        super().check(cfg, run_cfg)
        require(cfg.path, "dataset.path", cfg.path,
                "a file, folder or glob of text files for dataset=text")

    def documents(self) -> Documents:
        return files_documents(*local_files(self.cfg.path))
