#!/usr/bin/env python3
"""Tokenise text files into a fleetwise token file: the same as `fleetwise tokenize` (the code ships
in the package, fleetwise.data.tokenize_text, so an installed fleetwise has it too).

    python scripts/tokenize_text.py corpus.txt [more.txt ...] --out data/corpus.bin
"""

import sys

from fleetwise.data.tokenize_text import main

if __name__ == "__main__":
    sys.exit(main())
