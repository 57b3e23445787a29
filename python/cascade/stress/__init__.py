"""`cascade stress`: a randomized reliability harness in the spirit of RocksDB's db_stress.

Modes (docs/reliability.md has what each checks and how to run the long version):

    ops      threads and processes doing random operations, every hit verified
    kill     SIGKILL a writer at random moments, reopen, check flushed blocks
    corrupt  damage closed stores on disk, reopen, every read a miss or exact
    faults   fail each I/O call of the file tier in turn (EIO, torn, ENOSPC)

Block contents derive from (id, seed) (blocks.py), so every read is checked
byte for byte without keeping copies. The exit status is non-zero on any
wrong byte, lost flushed block, crash or hang.
"""
