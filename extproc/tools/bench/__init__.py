"""``extproc-dev bench``: scenarios on the simulator across arms, and the ext_proc overhead benchmark."""
