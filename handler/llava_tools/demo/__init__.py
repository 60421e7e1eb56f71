"""The demos: ``make demo``'s scripted session over a real local server (:mod:`.scripted`,
``python -m llava_tools.demo``), ``make web``'s chat page over one (:mod:`.web`, ``python -m
llava_tools.demo.web``), and the sample photo both use (:mod:`.samples`)."""

from .samples import sample_photo
from .scripted import main

__all__ = ["main", "sample_photo"]
