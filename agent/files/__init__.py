"""A job's own files: what it holds at the dump (jobfiles) and their put-back (jobfiles_restore), its working
directory's snapshot (workdir, workdir_taken, workdir_packs, cowgate) and put-back (workdir_restore), the move-aside
(aside), what criu makes again by path (remade, relink), root's file operations that never follow a link (beneath),
and the engine step over all of it (filestep).

May import network, pipeline, storage and processes."""
