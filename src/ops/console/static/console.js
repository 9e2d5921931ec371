// Draws the console's charts with uPlot: every <div class="chart" data-series="..."> holds its
// data as JSON ({"x": [unix seconds...], "series": [{"label": ..., "values": [...]}]}), put
// there (escaped) by the server. The pages work without this script, the charts aside.
"use strict";
(function () {
  var palette = ["#2f6fdd", "#d2452f", "#2f9e5b", "#b7791f", "#7b4fc9", "#0f8f9f", "#c2417f",
    "#5a6270", "#8a9a1b", "#e07b12"];
  // The drawn charts, for the browser tests to look at.
  window.sendquotaCharts = [];
  function draw(el) {
    var data = JSON.parse(el.dataset.series);
    var series = [{}];
    var columns = [data.x];
    data.series.forEach(function (s, i) {
      series.push({ label: s.label, stroke: palette[i % palette.length], width: 2,
        points: { show: true, size: 4 } });
      columns.push(s.values);
    });
    var width = function () { return Math.max(280, el.clientWidth); };
    var chart = new uPlot({ width: width(), height: 260, series: series,
      scales: { x: { time: true } }, axes: [{}, { size: 50 }] }, columns, el);
    window.addEventListener("resize", function () {
      chart.setSize({ width: width(), height: 260 });
    });
    window.sendquotaCharts.push({ id: el.id, chart: chart });
  }
  document.querySelectorAll(".chart[data-series]").forEach(draw);
})();
