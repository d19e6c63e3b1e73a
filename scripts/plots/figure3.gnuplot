# Paper Figure 3: the optimal gamma (Sec. 3.5) vs alpha for several draft costs c.
load "scripts/plots/common.gnuplot"
set output dir."/figure3_optimal_gamma.png"
set title "Optimal {/Symbol g} maximising Theorem 3.8 (Fig. 3)"
set xlabel "{/Symbol a} (acceptance rate)"
set ylabel "optimal {/Symbol g}"
set xrange [0:1]
set logscale y
set yrange [0.8:150]
set ytics (1, 2, 3, 5, 10, 20, 50, 100)
file = dir."/figure3_optimal_gamma.csv"
plot for [i=2:7] file using 1:i with steps lw 2 title columnheader(i)
