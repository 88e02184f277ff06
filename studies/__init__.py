"""Result studies of issue 16: scripts that evaluate trained runs and write the README tables and plots."""
