(function () {
  "use strict";
  var box = document.getElementById("only-flagged");
  var shown = document.getElementById("shown-count");
  var rounds = document.querySelectorAll("article.round");
  function apply() {
    document.body.classList.toggle("only-flagged", box.checked);
    var n = 0;
    for (var i = 0; i < rounds.length; i++) {
      if (!box.checked || rounds[i].getAttribute("data-flagged") === "1") { n++; }
    }
    shown.textContent = String(n) + " of " + String(rounds.length) + " rounds shown";
  }
  function setAll(open) {
    var ds = document.querySelectorAll("details");
    for (var i = 0; i < ds.length; i++) { ds[i].open = open; }
  }
  box.addEventListener("change", apply);
  document.getElementById("expand-all").addEventListener("click", function () { setAll(true); });
  document.getElementById("collapse-all").addEventListener("click", function () { setAll(false); });
  if (window.location.hash === "#flagged") { box.checked = true; }
  apply();
})();
