"""``python -m lora_layers.sim``: the ``lora-sim`` command."""

from . import main

raise SystemExit(main())
