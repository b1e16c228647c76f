"""Storage layouts: how dumps map onto the files of a destination, for writer and reader.

What the tracker writes and the reader reads must agree; that agreement lives here:

* :mod:`~trajtrack.layouts.names` -- dump names, the name template, temporary and reserved
  paths (``.trajtrack/``, ``.<name>.tmp~host~pid~id``);
* :mod:`~trajtrack.layouts.records` -- the record of what was written
  (``.trajtrack/records/*.jsonl``);
* :mod:`~trajtrack.layouts.torch_format` -- the facts of torch's checkpoint format the archive
  writer writes and the fast loader reads (rebuild functions, storage classes, protocol).
"""

from __future__ import annotations
