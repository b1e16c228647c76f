"""Storage layouts: how dumps map onto the files of a destination, for writer and reader.

What the tracker writes and the reader reads must agree; that agreement lives here:

* :mod:`~trajtrack.layouts.names` -- dump names, the name template, temporary and reserved
  paths (``.trajtrack/``, ``.<name>.tmp~host~pid~id``);
* :mod:`~trajtrack.layouts.records` -- the record of what was written
  (``.trajtrack/records/*.jsonl``);
* :mod:`~trajtrack.layouts.torch_format` -- the facts of torch's checkpoint format the archive
  writer writes and the fast loader reads (rebuild functions, storage classes, protocol).

Read the modules in this order::

    names.py         dump names: validation, the distributed name template, reserved paths
    records.py       the record of what was written, kept in the storage itself
    columns.py       record lines in columns (format version 2): many dumps in one JSON object
    shards.py        the shards layout's file format: plain POSIX tar files of dumps
    torch_format.py  facts of torch's checkpoint format the writer and the reader share
"""

from __future__ import annotations
