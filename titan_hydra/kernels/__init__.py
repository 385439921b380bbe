"""Hand-written CPU kernels, built on first use with torch's C++ extension loader, and the
checks that pick which kernel runs where."""
