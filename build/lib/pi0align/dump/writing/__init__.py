"""Writing dumped steps to the dump file, in a process of its own, each append all-or-nothing."""
