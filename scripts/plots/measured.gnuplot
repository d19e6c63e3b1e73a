# Measured speedups of bm_speedup (points) on the Theorem 3.8 curves (lines), one panel
# per draft cost c; colours are gamma. Drawn only when measured_speedup.csv exists.
load "scripts/plots/common.gnuplot"
set terminal pngcairo size 1500,520 enhanced font "Sans,11" linewidth 1.5
set output dir."/measured_speedup.png"
theory = dir."/theory_walltime.csv"
measured = dir."/measured_speedup.csv"
set multiplot layout 1,3 title "Measured speedup (points, bm\\_speedup) vs Theorem 3.8 (lines)"
set xlabel "{/Symbol a}"
set ylabel "speedup over plain target decoding"
set xrange [0.4:0.95]
set yrange [0:7]
gammas = "1 2 4 8"
costs = "0 0.05 0.2"
do for [k=1:3] {
  c = real(word(costs, k))
  set title sprintf("c = %g", c)
  plot for [j=1:4] theory using 1:(column(1 + 4*(k-1) + j)) with lines lw 2 lc j \
         title sprintf("{/Symbol g} = %s", word(gammas, j)), \
       for [j=1:4] measured using 1:((abs($3 - c) < 1e-9 && $2 == real(word(gammas, j))) ? $4 : NaN) \
         with points pt 7 ps 1.4 lc j notitle
}
unset multiplot
