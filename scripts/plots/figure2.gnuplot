# Paper Figure 2: expected tokens per run of Algorithm 1 vs alpha (Eq. 1), several gamma.
load "scripts/plots/common.gnuplot"
set output dir."/figure2_expected_tokens.png"
set title "Expected tokens per step, (1 - {/Symbol a}^{{/Symbol g}+1}) / (1 - {/Symbol a})  (Eq. 1, Fig. 2)"
set xlabel "{/Symbol a} (acceptance rate)"
set ylabel "expected tokens per target call"
set xrange [0:1]
set yrange [1:12]
file = dir."/figure2_expected_tokens.csv"
plot for [i=2:7] file using 1:i with lines lw 2 title columnheader(i), \
     file using 1:8 with lines dt 2 lc rgb "black" title "oracle 1/(1-{/Symbol a})"
