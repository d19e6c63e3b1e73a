# Paper Figure 4 and Table 1: walltime improvement (Thm 3.8) and increase in arithmetic
# operations (Thm 3.11) vs alpha, c = c_hat = 0; the printed Table 1 values as points.
load "scripts/plots/common.gnuplot"
set terminal pngcairo size 1280,560 enhanced font "Sans,11" linewidth 1.5
set output dir."/figure4_speed_operations.png"
file = dir."/figure4_speed_operations.csv"
points = dir."/table1_points.csv"
set multiplot layout 1,2 title "Speed and operations vs {/Symbol a}, c = ĉ = 0 (Fig. 4; points: Table 1 as printed)"
set xlabel "{/Symbol a} (acceptance rate)"
set xrange [0:1]
set ylabel "walltime improvement (Thm 3.8)"
set yrange [1:11]
plot for [i=2:5] file using 1:i with lines lw 2 title columnheader(i), \
     points using 1:4 with points pt 7 ps 1.3 lc rgb "black" title "Table 1"
set ylabel "operations factor (Thm 3.11)"
set yrange [1:11]
set key top right
plot for [i=6:9] file using 1:i with lines lw 2 title columnheader(i), \
     points using 1:3 with points pt 7 ps 1.3 lc rgb "black" title "Table 1"
unset multiplot
