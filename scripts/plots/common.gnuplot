# Shared settings for the specdec figures. Callers set `dir` (the CSV and PNG directory).
if (!exists("dir")) dir = "build/plots"
set datafile separator comma
set datafile missing "NaN"
set terminal pngcairo size 960,640 enhanced font "Sans,11" linewidth 1.5
set grid lc rgb "#dddddd"
set key top left box opaque
set border lw 1
