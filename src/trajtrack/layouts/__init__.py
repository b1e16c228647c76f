"""Storage layouts: how dumps map onto the files of a destination, for writer and reader.

What the tracker writes and the reader reads must agree; that agreement lives here:

* :mod:`~trajtrack.layouts.names` -- dump names, the name template, temporary and reserved
  paths (``.trajtrack/``, ``.<name>.tmp~host~pid~id``);
* :mod:`~trajtrack.layouts.records` -- the record of what was written
  (``.trajtrack/records/*.jsonl``).
"""

from __future__ import annotations
