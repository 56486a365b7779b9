from crowdtrain.cli import app

app()
